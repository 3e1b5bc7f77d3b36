"""`gpuwise fleet`: who used which devices, how much of them, at what cost, and whether owning pays.

sources.py reads the uses (Slurm's accounting, Ray's jobs, gpuwise's record); report.py turns them into the
figures. No scheduler of gpuwise's own: the engines' own records are read as they are."""
