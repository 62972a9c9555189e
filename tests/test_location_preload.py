"""The step forkserver's preloaded code location: kept for the environment it was imported in,
forgotten (and imported afresh) for another; a location that fails to import is left to the step."""

import json
import os
import subprocess
import sys
import textwrap

from tinker_pipelines.scheduler.location_preload import LOCATION_ENV

def _location(tmp_path, body: str) -> None:
    pkg = tmp_path / "myloc"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import os\nFLAG = os.environ.get('TINKER_PRELOAD_FLAG', '')\n")
    (pkg / "defs.py").write_text(body)


def _run(tmp_path, module: str, script: str, **env) -> subprocess.CompletedProcess:
    spec = json.dumps({"module": module, "working_directory": str(tmp_path)})
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, LOCATION_ENV: spec, **env}, cwd=tmp_path)


def test_the_location_is_kept_for_its_environment_and_imported_afresh_for_another(tmp_path):
    _location(tmp_path, "import torch\nimport tinker_pipelines.config\nfrom myloc import FLAG\n")
    script = textwrap.dedent("""
        import json, os, sys
        # what a launch passes: the launching process's environment, as the server started in it
        env = {k: v for k, v in os.environ.items() if k != "TINKER_STEP_PRELOAD_LOCATION"}
        from tinker_pipelines.scheduler import location_preload as lp

        location = json.loads(os.environ[lp.LOCATION_ENV])
        print(json.dumps(lp.preloaded()))
        assert not lp.refresh(env, os.getcwd(), location)  # the server's own environment: kept
        assert "myloc.defs" in sys.modules
        assert lp.refresh({**env, "TINKER_PRELOAD_FLAG": "2"}, os.getcwd(), location)
        assert "myloc" not in sys.modules and "myloc.defs" not in sys.modules
        assert "torch" in sys.modules and "tinker_pipelines.config" in sys.modules  # not the location's
        os.environ["TINKER_PRELOAD_FLAG"] = "2"  # as the step sets its environment, then imports
        sys.path.insert(0, location["working_directory"])
        import myloc.defs
        print(myloc.FLAG)
    """)
    r = _run(tmp_path, "myloc.defs", script, TINKER_PRELOAD_FLAG="1")
    assert r.returncode == 0, r.stderr[-2000:]
    preloaded, flag = r.stdout.strip().splitlines()[-2:]
    assert json.loads(preloaded) == ["myloc", "myloc.defs"]
    assert flag == "2"


def test_another_location_or_directory_forgets_it(tmp_path):
    _location(tmp_path, "X = 1\n")
    script = textwrap.dedent("""
        import json, os, sys
        env = {k: v for k, v in os.environ.items() if k != "TINKER_STEP_PRELOAD_LOCATION"}
        from tinker_pipelines.scheduler import location_preload as lp

        location = json.loads(os.environ[lp.LOCATION_ENV])
        assert not lp.refresh(env, os.getcwd(), location)  # the same: kept
        assert lp.refresh(env, "/", location) and "myloc.defs" not in sys.modules
    """)
    r = _run(tmp_path, "myloc.defs", script)
    assert r.returncode == 0, r.stderr[-2000:]
    script = script.replace('lp.refresh(env, "/", location)', 'lp.refresh(env, os.getcwd(), {**location, "module": "elsewhere"})')
    r = _run(tmp_path, "myloc.defs", script)
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_location_that_fails_to_import_is_left_to_the_step(tmp_path):
    _location(tmp_path, "raise RuntimeError('broken definitions')\n")
    script = ("from tinker_pipelines.scheduler import location_preload as lp\n"
              "import sys\nprint(lp.preloaded(), 'myloc.defs' in sys.modules)\n")
    r = _run(tmp_path, "myloc.defs", script)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "['myloc'] False"  # the package imported; the step retries defs


def test_a_package_installed_with_pip_target_on_pythonpath_is_not_the_locations(tmp_path):
    """A bare image gets dagster by `pip install --target DIR` and PYTHONPATH=DIR: its modules
    are installed packages, never forgotten in a step (a second copy of dagster would not know
    the first one's config types)."""
    site = tmp_path / "site"
    (site / "thirdparty").mkdir(parents=True)
    (site / "thirdparty" / "__init__.py").write_text("")
    (site / "thirdparty-1.0.dist-info").mkdir()
    own = tmp_path / "proj"
    (own / "mine").mkdir(parents=True)
    (own / "mine" / "__init__.py").write_text("")
    script = textwrap.dedent("""
        import sys, thirdparty, mine
        from tinker_pipelines.scheduler import location_preload as lp
        print(lp._location_module("thirdparty", thirdparty, "mine.defs"),
              lp._location_module("mine", mine, "mine.defs"))
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(own), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "True"]
