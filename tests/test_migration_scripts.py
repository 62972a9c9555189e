"""Alembic revision scripts parsed once per step server (`scheduler.migration_scripts`) and the
server's preloaded objects frozen out of its steps' collections (`scheduler.preload_freeze`)."""

import os
import subprocess
import sys
import textwrap


def _python(script: str, cwd) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                         timeout=300, cwd=cwd, env={**os.environ, "DAGSTER_HOME": str(cwd)})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


HEADS = """
    from alembic.config import Config
    from alembic.script import ScriptDirectory
    from dagster._core.storage.sql import ALEMBIC_SCRIPTS_LOCATION
    import mlflow.store, pathlib
    for location in (ALEMBIC_SCRIPTS_LOCATION, str(pathlib.Path(mlflow.store.__file__).parent / "db_migrations")):
        c = Config(); c.set_main_option("script_location", location)
        s = ScriptDirectory.from_config(c)
        print(sorted(s.get_heads()), len(list(s.walk_revisions())))
"""


def test_cached_scripts_give_the_same_revisions_and_reuse_their_modules(tmp_path):
    plain = _python(HEADS, tmp_path)
    cached = _python(textwrap.dedent("""
        from tinker_pipelines.scheduler import migration_scripts as m
        assert len(m._SCRIPTS) > 50, len(m._SCRIPTS)  # Dagster's and MLflow's, warmed at import
        from alembic.config import Config
        from alembic.script import ScriptDirectory
        from dagster._core.storage.sql import ALEMBIC_SCRIPTS_LOCATION
        c = Config(); c.set_main_option("script_location", ALEMBIC_SCRIPTS_LOCATION)
        a, b = (list(ScriptDirectory.from_config(c).walk_revisions()) for _ in range(2))
        assert [x.revision for x in a] == [y.revision for y in b]
        assert all(x.module is y.module and x is not y for x, y in zip(a, b))  # one import, new Scripts
    """) + textwrap.dedent(HEADS), tmp_path)
    assert cached == plain and plain


def test_a_changed_revision_file_is_imported_again(tmp_path):
    versions = tmp_path / "scripts" / "versions"
    versions.mkdir(parents=True)
    (tmp_path / "scripts" / "script.py.mako").write_text("")
    rev = versions / "aaa_first.py"
    rev.write_text("revision = 'aaa'\ndown_revision = None\nNOTE = 'one'\n")
    out = _python(f"""
        import os
        from tinker_pipelines.scheduler import migration_scripts
        from alembic.config import Config
        from alembic.script import ScriptDirectory
        c = Config(); c.set_main_option("script_location", {str(tmp_path / "scripts")!r})
        notes = [ScriptDirectory.from_config(c).get_revision("aaa").module.NOTE]
        with open({str(rev)!r}, "w") as f:
            f.write("revision = 'aaa'\\ndown_revision = None\\nNOTE = 'two, longer'\\n")
        notes.append(ScriptDirectory.from_config(c).get_revision("aaa").module.NOTE)
        print(notes)
    """, tmp_path)
    assert out == "['one', 'two, longer']"


def test_a_dagster_instance_is_created_and_reopened_with_the_cache(tmp_path):
    """Creating the storages runs the migrations (`env.py`, never cached); reopening checks the
    revision against the cached scripts."""
    out = _python("""
        from tinker_pipelines.scheduler import migration_scripts
        import dagster as dg
        for _ in range(2):
            instance = dg.DagsterInstance.get()
            print(len(instance.get_runs()))
            instance.dispose()
    """, tmp_path)
    assert out.split() == ["0", "0"]


def test_the_preloaded_objects_are_frozen():
    code = "import gc; n = gc.get_freeze_count(); import tinker_pipelines.scheduler.preload_freeze; " \
           "print(n, gc.get_freeze_count() > 1000)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True"]
