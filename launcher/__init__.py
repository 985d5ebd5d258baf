"""Starting and supervising worker processes, Prefect-free: torchrun commands and the rendezvous
across nodes (`launch`), the forkserver and forked workers (`forkserver`, `forked`), warm pools
that outlive a job (`warm_pool`, `warm_launch`), a job's workers kept across its segments
(`job_workers`), process trees (`processes`). It starts
`parashift.trainer.worker` by module name and never imports the trainer's training code.
"""
