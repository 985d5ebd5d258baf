"""Checks for the URLs a job spec names: where the corpus is read from and where state is stored.

Only the spelling is checked here (no network, no fsspec import): a URL is `scheme://location`
with a scheme from an allow-list, or a plain local path.
"""

from __future__ import annotations

import re

DATA_SCHEMES = frozenset(
    {"file", "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "http", "https", "hf", "builtin"}
)
STORAGE_SCHEMES = frozenset({"file", "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
# Corpora shipped with parashift itself (`builtin://NAME`).
BUILTIN_CORPORA = frozenset({"python-stdlib"})

# RFC 3986 scheme syntax, lower case only (fsspec protocols are lower case).
_SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*$")
# A plain path that starts like a URL with a typo: `s3//bucket`, `s3:/bucket`, `s3:bucket`.
_SCHEME_TYPO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*)(?::/{0,1}(?!/)|//)")


def check_url(url: str, schemes: frozenset[str], *, what: str) -> str:
    """Return `url` unchanged, or raise ValueError saying what is wrong with it."""
    if not url.strip():
        raise ValueError(f"{what} URL must not be empty")
    if any(ch.isspace() for ch in url):
        raise ValueError(f"{what} URL must not contain whitespace (got {url!r})")
    allowed = ", ".join(sorted(schemes))
    if "://" not in url:
        typo = _SCHEME_TYPO.match(url)
        if typo and (":" in url.split("/", 1)[0] or typo.group("scheme").lower() in schemes):
            scheme = typo.group("scheme")
            rest = url[typo.end() :]
            raise ValueError(
                f"malformed URL scheme in {url!r}: write it as '{scheme.lower()}://{rest}' "
                "(or use a plain local path)"
            )
        return url
    scheme, _, location = url.partition("://")
    if not _SCHEME.match(scheme):
        raise ValueError(f"malformed URL scheme {scheme!r} in {url!r} (expected e.g. 's3://bucket/key')")
    if scheme not in schemes:
        raise ValueError(f"unsupported URL scheme {scheme!r} (allowed: {allowed}, or a plain local path)")
    if not location:
        raise ValueError(f"URL {url!r} names no location after '{scheme}://'")
    if scheme == "builtin" and location not in BUILTIN_CORPORA:
        known = ", ".join(f"builtin://{name}" for name in sorted(BUILTIN_CORPORA))
        raise ValueError(f"unknown built-in corpus {location!r} (known: {known})")
    return url
