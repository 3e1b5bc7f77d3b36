"""`gpuwise launch`: a planned training job handed to Slurm, Ray, SkyPilot or Kubernetes.

`job` plans the job and holds its layout; `engines` holds what the engines share and `registry` names them; one
module per engine writes its artifact and speaks to its client; `ray_nodes` is the driver a Ray job runs on the
cluster.
"""
