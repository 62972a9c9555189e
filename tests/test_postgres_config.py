"""docs/dagster.production.yaml: valid for dagster's schema, and opens against a real Postgres,
where runs and events persist.

The schema test needs no server: the yaml, every class it names and the SQLAlchemy driver its
URL selects are checked as DagsterInstance would on start-up. The server is PostgreSQL 16 from the `pgserver` wheel (the test extra), started by this fixture
from its binaries: no TCP listener (`listen_addresses=''`), only a Unix socket in a private
directory, password authentication for the role the yaml names. Postgres refuses to run as root,
so as root the binaries are copied to a directory other users can read and run as `nobody`
(pgserver's own launcher would add a system user and open up every parent directory instead).
The yaml reads host, user, password and database from DAGSTER_PG_*. To reach a socket, the host
is empty (a URL cannot carry a directory as its host), which leaves it to libpq: PGHOST names the
socket directory, and the yaml's port 5432 the socket in it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
import pytest
import sqlalchemy
from dagster import DagsterInstance
from dagster._config import process_config
from dagster._core.definitions.definition_config_schema import convert_user_facing_definition_config_schema
from dagster._core.instance.config import dagster_instance_config

ROOT = Path(__file__).resolve().parents[1]
PRODUCTION_YAML = ROOT / "docs" / "dagster.production.yaml"
USER, PASSWORD, DB, PORT = "dagster", "s3cret-for-the-test", "dagster", "5432"
ENV = ("DAGSTER_PG_HOST", "DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB", "DAGSTER_COMPUTE_LOG_DIR")


def _validate(schema, value):
    result = process_config(convert_user_facing_definition_config_schema(schema).config_type, value)
    assert result.success, result.errors
    return result.value


def test_production_yaml_fits_dagsters_schema(tmp_path, monkeypatch):
    from dagster_postgres import DagsterPostgresStorage
    from dagster_postgres.utils import pg_url_from_config

    for name in ENV:
        monkeypatch.setenv(name, f"value-of-{name.lower()}")
    shutil.copy(PRODUCTION_YAML, tmp_path / "dagster.yaml")
    config, custom_class = dagster_instance_config(str(tmp_path))
    assert custom_class is None and set(config["storage"]) == {"postgres"}
    storage = _validate(DagsterPostgresStorage.config_type(), config["storage"]["postgres"])
    assert storage["postgres_db"]["hostname"] == "value-of-dagster_pg_host"
    url = sqlalchemy.engine.make_url(pg_url_from_config(storage))
    url.get_dialect().import_dbapi()  # the driver the URL asks for is installed (SQLAlchemy 2.1 changed the default)
    for section in ("run_coordinator", "run_launcher", "compute_logs"):
        cls = getattr(importlib.import_module(config[section]["module"]), config[section]["class"])
        _validate(cls.config_type(), config[section].get("config") or {})
    with pytest.raises(AssertionError):  # the check above can fail
        _validate(DagsterPostgresStorage.config_type(), {"postgres_db": {"hostname": "h"}})


def _pg_install(tmp: Path, uid: int) -> Path:
    if sys.version_info >= (3, 13):  # the marker in pyproject.toml's test extra
        pytest.skip("pgserver ships no wheel for Python 3.13+; the schema test still runs")
    spec = importlib.util.find_spec("pgserver")
    assert spec and spec.origin, "pgserver (the test extra) is not installed: run scripts/setup"
    package = Path(spec.origin).parent
    assert (package / "pginstall" / "bin" / "postgres").exists(), f"no postgres binaries in {package}"
    if uid == os.geteuid():
        return package / "pginstall"
    # Where `nobody` can read them (site-packages may be under /root). The binaries find their
    # libraries at $ORIGIN/../../../pgserver.libs, so the wheel's layout is kept.
    shutil.copytree(package / "pginstall", tmp / "pgserver" / "pginstall", symlinks=True)
    shutil.copytree(package.parent / "pgserver.libs", tmp / "pgserver.libs", symlinks=True)
    for path in (tmp / "pgserver", *[p for p in tmp.rglob("*") if p.is_dir()]):
        path.chmod(0o755)
    return tmp / "pgserver" / "pginstall"


@pytest.fixture(scope="module")
def postgres(tmp_path_factory: pytest.TempPathFactory):
    """Environment variables for the production yaml, pointing at a fresh Postgres."""
    tmp = Path(tempfile.mkdtemp(prefix="tinker-pg-"))  # in /tmp: pytest's own tree is 0700 to `nobody`
    try:
        yield from _serve(tmp, tmp_path_factory.mktemp("compute_logs"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _serve(tmp: Path, compute_logs: Path):
    tmp.chmod(0o755)
    runas = pwd.getpwnam("nobody") if os.geteuid() == 0 else pwd.getpwuid(os.geteuid())
    install = _pg_install(tmp, runas.pw_uid)
    as_user = {"user": runas.pw_uid, "group": runas.pw_gid} if runas.pw_uid != os.geteuid() else {}
    data, sockets, pwfile = tmp / "data", tmp / "sockets", tmp / "pwfile"
    data.mkdir(mode=0o700)
    sockets.mkdir(mode=0o700)
    pwfile.write_text(PASSWORD + "\n")
    for path in (data, sockets, pwfile):
        os.chown(path, runas.pw_uid, runas.pw_gid)
    env = {"PATH": os.environ.get("PATH", ""), "LC_ALL": "C", "HOME": str(tmp)}

    def pg(*args: str, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run([str(install / "bin" / args[0]), *args[1:]], env=env, capture_output=True,
                              text=True, timeout=120, cwd=tmp, **as_user, **kwargs)
        assert done.returncode == 0, f"{args[0]}: {done.stdout}{done.stderr}"
        return done

    pg("initdb", "-D", str(data), "-U", USER, f"--pwfile={pwfile}", "--auth=scram-sha-256", "-E", "UTF8")
    server = subprocess.Popen([str(install / "bin" / "postgres"), "-D", str(data), "-c", "listen_addresses=",
                               "-k", str(sockets), "-p", PORT], env=env, cwd=tmp, stdout=subprocess.DEVNULL,
                              stderr=open(tmp / "postgres.log", "wb"), **as_user)
    try:
        deadline = time.monotonic() + 60
        while subprocess.run([str(install / "bin" / "pg_isready"), "-h", str(sockets), "-p", PORT],
                             env=env, capture_output=True).returncode != 0:
            assert server.poll() is None and time.monotonic() < deadline, (tmp / "postgres.log").read_text()
            time.sleep(0.2)
        env["PGPASSWORD"] = PASSWORD
        pg("createdb", "-h", str(sockets), "-p", PORT, "-U", USER, DB)
        yield {"DAGSTER_PG_HOST": "", "PGHOST": str(sockets), "DAGSTER_PG_USER": USER,
               "DAGSTER_PG_PASSWORD": PASSWORD, "DAGSTER_PG_DB": DB,
               "DAGSTER_COMPUTE_LOG_DIR": str(compute_logs)}
    finally:
        server.send_signal(signal.SIGQUIT)  # immediate shutdown: the database is thrown away
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@dg.asset
def tiny_number() -> int:
    return 7


def _instance(home: Path) -> DagsterInstance:
    return DagsterInstance.from_config(str(home))


@pytest.mark.e2e
def test_production_yaml_runs_on_postgres(tmp_path, postgres, monkeypatch):
    for name, value in postgres.items():
        monkeypatch.setenv(name, value)
    home = tmp_path / "dagster_home"
    home.mkdir()
    shutil.copy(PRODUCTION_YAML, home / "dagster.yaml")  # as its first line tells a deployment to
    with _instance(home) as instance:
        assert [type(s).__name__ for s in (instance.run_storage, instance.event_log_storage,
                                           instance.schedule_storage)] == [
            "PostgresRunStorage", "PostgresEventLogStorage", "PostgresScheduleStorage"]
        assert type(instance.run_coordinator).__name__ == "TinkerRunCoordinator"
        result = dg.materialize([tiny_number], instance=instance)
        assert result.success and result.output_for_node("tiny_number") == 7
        run_id = result.run_id
    with _instance(home) as fresh:  # a new connection: what was written is in the database
        run = fresh.get_run_by_id(run_id)
        assert run is not None and run.is_success
        event = fresh.get_latest_materialization_event(dg.AssetKey("tiny_number"))
        assert event is not None and event.run_id == run_id
        assert fresh.get_concurrency_config().pool_config.default_pool_limit == 8


@pytest.mark.e2e
def test_the_server_checks_passwords(postgres):
    """So the test above can only pass with the password the yaml reads (no trust authentication)."""
    import psycopg2

    params = {"host": postgres["PGHOST"], "port": PORT, "user": USER, "dbname": DB}
    with pytest.raises(psycopg2.OperationalError, match=f'password authentication failed for user "{USER}"'):
        psycopg2.connect(**params, password="not-the-password")
    psycopg2.connect(**params, password=PASSWORD).close()
