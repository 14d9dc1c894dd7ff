"""What the tests share: real mpiexec worlds with deadlines (mpiworld), the code ranks run first
(engine_worlds, rank_api_checks, world_checks), IPython kernels (kernel_driver), Keras worlds
(keras_worlds), and the multi-host and Slurm test worlds (testhosts, slurmcluster)."""
