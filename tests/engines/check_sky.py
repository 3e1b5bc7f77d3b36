"""Load a SkyPilot task YAML with SkyPilot itself and print what it understood.

Usage (with the engines venv made by tests/engines/engines_venv.sh):

    DIR/bin/python tests/engines/check_sky.py task.yaml

Prints one JSON object to stdout. Exits 1 with a single line on stderr when
SkyPilot rejects the YAML. Needs no cloud credentials and no network: it only
calls ``sky.Task.from_yaml``, which validates against SkyPilot's schema and
builds Resources/Storage objects without contacting any cloud. Accelerator
names are NOT canonicalized or checked at this stage (SkyPilot does that in
the optimizer, which needs the online catalog), so e.g. ``FOO:1`` passes.

SkyPilot writes a few files under ``~/.sky``; to keep the caller's home clean
(and to ignore any ~/.sky/config.yaml there) HOME points at a temporary
directory unless CHECK_SKY_KEEP_HOME=1.
"""

import contextlib
import json
import os
import shutil
import sys
import tempfile


def _jsonable(value):
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if hasattr(value, 'value') and hasattr(value, 'name'):  # enum
        return _jsonable(value.value)
    return str(value)


def _resources(r):
    out = {
        'cloud': None if r.cloud is None else str(r.cloud),
        'region': r.region,
        'zone': r.zone,
        'accelerators': _jsonable(r.accelerators),
        'use_spot': r.use_spot,
    }
    # In this SkyPilot (0.14.x) autostop lives in Resources.autostop_config
    # (an AutostopConfig dataclass: enabled, idle_minutes, down, wait_for).
    autostop = getattr(r, 'autostop_config', None)
    if autostop is not None:
        cfg = autostop.to_yaml_config()  # False or {idle_minutes, down, ...}
        out['autostop'] = _jsonable(cfg)
    job_recovery = getattr(r, 'job_recovery', None)
    if job_recovery is not None:
        out['job_recovery'] = _jsonable(job_recovery)
    return out


def _storage(path, storage):
    try:
        cfg = storage.to_yaml_config()
    except Exception:  # pylint: disable=broad-except
        cfg = {'name': getattr(storage, 'name', None),
               'source': getattr(storage, 'source', None)}
    cfg = _jsonable(cfg)
    cfg['mount_path'] = path
    return cfg


def _describe(task):
    resources = task.resources
    if isinstance(resources, list):
        kind = 'ordered'
        items = [_resources(r) for r in resources]
    else:
        kind = 'any_of' if len(resources) > 1 else 'single'
        # A set has no stable order: sort for reproducible output.
        items = sorted((_resources(r) for r in resources),
                       key=lambda d: json.dumps(d, sort_keys=True))
    return {
        'name': task.name,
        'num_nodes': task.num_nodes,
        'setup': task.setup,
        'run': task.run if isinstance(task.run, (str, type(None))) else
               str(task.run),
        'envs': _jsonable(task.envs),
        'file_mounts': _jsonable(task.file_mounts or {}),
        'storage_mounts': {
            path: _storage(path, st)
            for path, st in (task.storage_mounts or {}).items()
        },
        'resources_kind': kind,
        'resources': items,
    }


def main(argv):
    if len(argv) != 2:
        print('usage: check_sky.py TASK.yaml', file=sys.stderr)
        return 2
    path = os.path.abspath(argv[1])
    tmp_home = None
    if os.environ.get('CHECK_SKY_KEEP_HOME') != '1':
        tmp_home = tempfile.mkdtemp(prefix='check_sky_home_')
        os.environ['HOME'] = tmp_home
    try:
        # Anything SkyPilot prints while loading goes to stderr, so stdout
        # carries only the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            try:
                import sky  # pylint: disable=import-outside-toplevel
                task = sky.Task.from_yaml(path)
                result = _describe(task)
            except Exception as e:  # pylint: disable=broad-except
                lines = str(e).strip().splitlines() or ['']
                print(f'check_sky: rejected {argv[1]}: '
                      f'{type(e).__name__}: {lines[0]}',
                      file=sys.__stderr__)
                return 1
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    finally:
        if tmp_home is not None:
            shutil.rmtree(tmp_home, ignore_errors=True)


if __name__ == '__main__':
    sys.exit(main(sys.argv))
