"""Slurm: an sbatch script. One task per node runs torchrun, which starts that node's processes; gpuwise
itself never runs as a Slurm task per GPU as well (Fabric's SLURM environment hangs or trains on one GPU
when the two are mixed: Lightning #18504, #20391).

Before the time limit Slurm sends USR1 to the batch shell (--signal=B:USR1@...). The shell has Slurm send
TERM to the job's steps; torchrun hands it to the processes; gpuwise ends the step, writes a checkpoint
and exits. The shell then requeues the job, and the requeued job resumes from that checkpoint.
"""

from __future__ import annotations

import re
from pathlib import Path

from gpuwise.errors import GpuwiseError
from gpuwise.launch.endpoint import DRAIN_S, Endpoint
from gpuwise.launch.engines import STATE_TIMEOUT_S, Engine, Options, run_client
from gpuwise.launch.job import SHUTDOWN_GRACE_S, Job

# srun passes no --cpus-per-task of the job to its step on Slurm 22.05-23.02: said again, or the step gets one CPU.
SRUN = 'srun --kill-on-bad-exit=1 --cpus-per-task="$SLURM_CPUS_PER_TASK" '
# USR1 this long before the limit: Slurm checks signals about once a minute, then the processes get
# SHUTDOWN_GRACE_S to end their step and write the checkpoint.
SIGNAL_AHEAD_S = SHUTDOWN_GRACE_S + 90


def hms(seconds: int) -> str:
    """sbatch --time as D-HH:MM:SS."""
    d, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}"


class Slurm(Engine):
    name, suffix, client = "slurm", ".sbatch", "sbatch"
    install = "install Slurm's clients (Debian: apt-get install slurm-client) and point SLURM_CONF at your cluster"

    def check(self, job: Job, opts: Options) -> None:
        super().check(job, opts)
        # #SBATCH lines are not read by a shell: no quoting, and '%' is a file-name pattern there.
        if any(ch.isspace() or ch == "%" for ch in job.run_dir):
            raise GpuwiseError(f"--run-dir {job.run_dir}: Slurm's --output cannot hold a space or '%'; choose another")

    def render(self, job: Job, opts: Options) -> str:
        c = job.choice
        run = Path(job.run_dir)
        log = run.parent / f"{run.name}-slurm-%j.out"
        gpus = f"{opts.gres_type}:{c.per_node}" if opts.gres_type else str(c.per_node)
        lines = [
            "#!/bin/bash",
            f"# {job.headline()}",
            f"#SBATCH --job-name={job.name}",
            f"#SBATCH --nodes={c.nodes}",
            "#SBATCH --ntasks-per-node=1",
            *([f"#SBATCH --gpus-per-node={gpus}"] if job.accelerator == "cuda" else []),
            f"#SBATCH --cpus-per-task={job.cpus_per_node}",
            f"#SBATCH --mem={job.mem_per_node_gib}G",
            f"#SBATCH --time={hms(job.time_limit_s)}",
            "#SBATCH --requeue",
            f"#SBATCH --signal=B:USR1@{SIGNAL_AHEAD_S}",
            "#SBATCH --open-mode=append",
            f"#SBATCH --output={log}",
            *(f"#SBATCH --{k}={v}" for k, v in (("partition", opts.partition), ("account", opts.account),
                                                 ("qos", opts.qos)) if v),  # fmt: skip
            "",
            "set -uo pipefail",
            'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
            "requeue=0",
            "# USR1: the time limit is near. TERM to every step of the job (scancel without --batch), so torchrun on",
            "# each node passes it to its processes: each ends its step, writes a checkpoint and stops. TERM sent to",
            "# srun itself would kill the step at once. Then the job is requeued, and resumes from that checkpoint.",
            "trap 'requeue=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
            # No --node-rank: srun starts the command without a shell, so no per-node variable reaches it; c10d
            # rendezvous numbers the nodes itself.
            job.node_script(opts.python, None, "$HEAD", "$SLURM_JOB_ID", "$SLURM_JOB_NUM_NODES",
                            launcher=SRUN).rstrip("\n")  # fmt: skip
            + " &",
            "step=$!",
            "while :; do",
            '  wait "$step"; status=$?',
            '  if [ "$status" -gt 128 ] && kill -0 "$step" 2>/dev/null; then continue; fi  # a trap cut it short',
            "  break",
            "done",
            'if [ "$requeue" = 1 ]; then',
            '  echo "gpuwise: the time limit is near: checkpoint written, requeueing job $SLURM_JOB_ID" >&2',
            '  scontrol requeue "$SLURM_JOB_ID"  # Slurm ends this shell here',
            "  exit 0",
            "fi",
            'exit "$status"',
            "",
        ]
        return "\n".join(lines)

    def preflight(self, job: Job, opts: Options) -> None:
        """sbatch --test-only: Slurm checks the script against the cluster's partitions and nodes (a node
        shape it does not have would pend for ever) and submits nothing."""
        sbatch = self.need_client()
        run_client([sbatch, "--test-only"], "Slurm cannot run the job", input=self.render(job, opts))

    def submit(self, artifact: Path, job: Job, opts: Options) -> str:
        sbatch = self.need_client()
        Path(job.run_dir).parent.mkdir(parents=True, exist_ok=True)  # the log is written beside the run
        out = run_client([sbatch, "--parsable", str(artifact)], "sbatch refused the job")
        job_id = out.strip().split(";")[0]
        if not re.fullmatch(r"\d+", job_id):
            raise GpuwiseError(f"sbatch answered '{out.strip()[:80]}', not a job id")
        return job_id

    def state(self, job_id: str, data: dict) -> str:
        # scontrol knows a job until MinJobAge after it ends; sacct, where accounting is kept, after that.
        try:
            out = run_client(["scontrol", "-o", "show", "job", job_id], "scontrol", timeout=STATE_TIMEOUT_S)
        except GpuwiseError:
            accounted = run_client(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State"], "sacct",
                                   timeout=STATE_TIMEOUT_S).split()  # fmt: skip
            return accounted[0] if accounted else "UNKNOWN"
        found = re.search(r"JobState=(\S+)", out)
        return found.group(1) if found else "UNKNOWN"


    # --- an endpoint: `gpuwise serve` in the batch shell's place, on the allocated node -----------------------

    def check_endpoint(self, ep: Endpoint, opts: Options) -> None:
        super().check_endpoint(ep, opts)
        if any(ch.isspace() or ch == "%" for ch in ep.run_dir):
            raise GpuwiseError(f"--run-dir {ep.run_dir}: Slurm's --output cannot hold a space or '%'; choose another")

    def drain_s(self) -> int:
        """serve --grace within the cluster's KillWait (the seconds between scancel's TERM and its KILL), asked
        of scontrol where it answers; else within Slurm's default."""
        try:
            out = run_client(["scontrol", "show", "config"], "scontrol", timeout=STATE_TIMEOUT_S)
        except GpuwiseError:
            return DRAIN_S
        found = re.search(r"^KillWait\s*=\s*(\d+)", out, re.M)
        return max(1, min(DRAIN_S, int(found.group(1)) - 3)) if found else DRAIN_S

    def render_endpoint(self, ep: Endpoint, opts: Options) -> str:
        run = Path(ep.run_dir)
        array = ep.replicas > 1
        log = run / ("slurm-%A_%a.out" if array else "slurm-%j.out")
        gpus = f"{opts.gres_type}:{ep.gpus}" if opts.gres_type else str(ep.gpus)
        grace = self.drain_s()
        # The replica's own address file: Slurm sets the array index in the job's environment.
        announce = f"{run}/replica-${{SLURM_ARRAY_TASK_ID:-0}}.json"
        serve = ep.serve_command(host="0.0.0.0", port=opts.port)
        serve[serve.index("--grace") + 1] = str(grace)
        import shlex

        lines = [
            "#!/bin/bash",
            f"# {ep.headline()}",
            "# sbatch this file. The replica announces its address in its file beside the log; scancel drains it:",
            f"# Slurm sends TERM, the server finishes its in-flight requests within {grace} s, inside KillWait.",
            f"#SBATCH --job-name={ep.name}",
            "#SBATCH --nodes=1",
            "#SBATCH --ntasks=1",
            *([f"#SBATCH --gpus-per-node={gpus}"] if ep.accelerator == "cuda" else []),
            f"#SBATCH --cpus-per-task={ep.cpus}",
            f"#SBATCH --mem={ep.mem_gib}G",
            *([f"#SBATCH --time={hms(opts.time_limit_s)}"] if opts.time_limit_s else []),
            *([f"#SBATCH --array=0-{ep.replicas - 1}"] if array else []),
            f"#SBATCH --output={log}",
            *(f"#SBATCH --{k}={v}" for k, v in (("partition", opts.partition), ("account", opts.account),
                                                 ("qos", opts.qos)) if v),  # fmt: skip
            "",
            "set -euo pipefail",
            "unset GPUWISE_API_KEY  # sbatch passes the submitting shell's environment on: the key file decides",
            # exec: the server is the job's process, so scancel's TERM reaches it and nothing else
            f'exec {shlex.join([opts.python, "-m", "gpuwise", *serve])} --announce "{announce}"',
            "",
        ]
        return "\n".join(lines)

    def preflight_endpoint(self, ep: Endpoint, opts: Options) -> None:
        sbatch = self.need_client()
        run_client([sbatch, "--test-only"], "Slurm cannot run the endpoint", input=self.render_endpoint(ep, opts))

    def submit_endpoint(self, artifact: Path, ep: Endpoint, opts: Options) -> str:
        sbatch = self.need_client()
        Path(ep.run_dir).mkdir(parents=True, exist_ok=True)
        out = run_client([sbatch, "--parsable", str(artifact)], "sbatch refused the endpoint")
        job_id = out.strip().split(";")[0]
        if not re.fullmatch(r"\d+", job_id):
            raise GpuwiseError(f"sbatch answered '{out.strip()[:80]}', not a job id")
        return job_id

    def stop(self, job_id: str, data: dict) -> str:
        # scancel: TERM to the job's processes (the server drains), KILL after KillWait
        run_client(["scancel", job_id], "scancel")
        if data.get("endpoint"):
            return f"scancel {job_id}: Slurm sent TERM; each server drains its in-flight requests, then exits"
        return f"scancel {job_id}: Slurm sent TERM; torchrun's processes end their step and write a checkpoint"
