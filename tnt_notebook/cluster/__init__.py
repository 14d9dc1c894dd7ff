"""Starts and watches a world of ranks, for the notebook (``%tnt_cluster``) and the shell
(``tnt-run``) alike: the launch plan and its options, hostfiles, the launcher backends, what the
launchers report, processes, Slurm, and the sweeping of what killed worlds leave behind."""
