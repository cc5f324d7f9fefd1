"""The production instance configs in deploy/postgres/ load through Dagster's own validation.

The instance config is validated and built by Dagster (`DagsterInstance.from_config`) against a PostgreSQL
server of the session's (tests/postgres_server.py), its storage resolved to dagster-postgres with the
connection from the environment; the run-launcher samples (Kubernetes, Docker) are built into instances
the same way and validated against the launchers' own config schemas from the real dagster-k8s /
dagster-docker releases (the `deploy` extra, in `dev`); the whole Dagster family is one release, so no
library warns of a version mismatch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import dagster as dg
import pytest
import yaml
from dagster_postgres import PostgresEventLogStorage, PostgresRunStorage, PostgresScheduleStorage

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "postgres"
LAUNCHERS = {
    "run_launcher.k8s.yaml": ("dagster_k8s", "K8sRunLauncher"),
    "run_launcher.docker.yaml": ("dagster_docker", "DockerRunLauncher"),
}
DATABASE = "eagle3_deploy_configs"  # this module's own, beside the micro run's on the same server


@pytest.fixture(scope="module")
def connection(postgres) -> Iterator[dict[str, str]]:
    """The DAGSTER_PG_* variables for a database of this module's own on the session's PostgreSQL server."""
    conn = postgres.connect()
    conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute(f"CREATE DATABASE {DATABASE} OWNER {postgres.env['DAGSTER_PG_USER']}")
    try:
        yield {**postgres.env, "DAGSTER_PG_DB": DATABASE}
    finally:
        with conn.cursor() as cur:
            cur.execute(f"DROP DATABASE {DATABASE} WITH (FORCE)")
        conn.close()


@pytest.fixture
def pg_env(connection, monkeypatch) -> dict[str, str]:
    for key, value in connection.items():
        monkeypatch.setenv(key, value)
    return connection


def home_with(tmp_path: Path, *parts: str) -> Path:
    """A DAGSTER_HOME whose dagster.yaml is deploy/postgres/dagster.yaml with `parts` appended, as docs/deployment.md says."""
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    text = "\n".join((DEPLOY / name).read_text() for name in ("dagster.yaml", *parts))
    (home / "dagster.yaml").write_text(text)
    return home


def test_postgres_instance_reads_its_connection_and_password_from_the_environment(tmp_path, pg_env) -> None:
    home = home_with(tmp_path)
    config = yaml.safe_load((home / "dagster.yaml").read_text())
    assert config["storage"]["postgres"]["postgres_db"]["password"] == {"env": "DAGSTER_PG_PASSWORD"}
    with dg.DagsterInstance.from_config(str(home)) as instance:  # validated, then connected to the server
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.event_log_storage, PostgresEventLogStorage)
        assert isinstance(instance.schedule_storage, PostgresScheduleStorage)
        assert type(instance.run_launcher) is dg.DefaultRunLauncher  # a run: a subprocess beside the daemon
        url = instance.run_storage.postgres_url
    env = pg_env
    assert url == (
        f"postgresql+psycopg2://{env['DAGSTER_PG_USER']}:{env['DAGSTER_PG_PASSWORD']}"
        f"@{env['DAGSTER_PG_HOST']}:{env['DAGSTER_PG_PORT']}/{env['DAGSTER_PG_DB']}"
    )
    assert env["DAGSTER_PG_PASSWORD"] not in "".join(p.read_text() for p in DEPLOY.iterdir())


def test_postgres_instance_keeps_every_setting_of_the_local_instance() -> None:
    """Only where runs are stored differs: the pools, run monitoring and retries are the same."""
    local = yaml.safe_load((ROOT / "dagster_home" / "dagster.yaml").read_text())
    production = yaml.safe_load((DEPLOY / "dagster.yaml").read_text())
    assert set(production.pop("storage")) == {"postgres"}
    assert production == local


@pytest.mark.parametrize("sample", sorted(LAUNCHERS))
def test_launcher_sample_is_a_valid_instance_config(tmp_path, pg_env, sample) -> None:
    home = home_with(tmp_path, sample)
    # Built without its run launcher (Dagster builds that on first use; the k8s one needs a cluster).
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert isinstance(instance.run_storage, PostgresRunStorage)
        assert isinstance(instance.run_coordinator, dg.QueuedRunCoordinator)
    launcher = yaml.safe_load((home / "dagster.yaml").read_text())["run_launcher"]
    assert (launcher["module"], launcher["class"]) == LAUNCHERS[sample]


# In a child, so that importing the launchers (kubernetes, docker) costs the test run nothing else.
VALIDATE = r"""
import json, sys
import dagster as dg

def launcher_class(module, name):
    return getattr(__import__(module), name)

def validate(cls, config):
    # Dagster's config validation through its public entry point: a job whose one op takes the launcher's schema.
    @dg.op(config_schema=cls.config_type())
    def launcher():
        pass

    @dg.job
    def launcher_config():
        launcher()

    try:
        run_config = dg.validate_run_config(launcher_config, {"ops": {"launcher": {"config": config}}})
    except dg.DagsterInvalidConfigError as e:
        return None, [error.message for error in e.errors]
    return run_config["ops"]["launcher"]["config"], []

out = {}
for name, (module, cls_name, config) in json.loads(sys.argv[1]).items():
    cls = launcher_class(module, cls_name)
    value, errors = validate(cls, config)
    out[name] = {"ok": value is not None, "errors": errors}
    if value is None:
        continue
    if cls_name == "DockerRunLauncher":
        from dagster_docker.utils import validate_docker_image
        launcher = cls.from_config_value(None, value)  # as the instance builds it from its config
        validate_docker_image(launcher.image)
    else:  # the Job a run gets, built the way K8sRunLauncher builds it (no cluster is contacted)
        from dagster_k8s.job import DagsterK8sJobConfig, UserDefinedDagsterK8sConfig, construct_dagster_k8s_job
        fields = ["job_image", "dagster_home", "image_pull_policy", "image_pull_secrets", "service_account_name",
                  "instance_config_map", "postgres_password_secret", "env_config_maps", "env_secrets", "env_vars",
                  "volume_mounts", "volumes", "labels", "resources", "scheduler_name", "security_context"]
        job_config = DagsterK8sJobConfig(**{k: value[k] for k in fields if k in value})
        job = construct_dagster_k8s_job(job_config, ["dagster", "api", "execute_run", "{}"], "dagster-run-test",
                                        UserDefinedDagsterK8sConfig.from_dict(value.get("run_k8s_config", {})))
        pod = job.spec.template.spec
        container = pod.containers[0]
        out[name]["job"] = {
            "claims": [v.persistent_volume_claim.claim_name for v in pod.volumes if v.persistent_volume_claim],
            "mounts": [m.mount_path for m in container.volume_mounts],
            "password_env": [e.value_from.secret_key_ref.name for e in container.env
                             if e.name == "DAGSTER_PG_PASSWORD" and e.value_from],
            "config_maps": [s.config_map_ref.name for s in container.env_from if s.config_map_ref],
        }
print(json.dumps(out))
"""


def validate_launchers(configs: dict[str, tuple[str, str, dict]]) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", VALIDATE, json.dumps(configs)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_launcher_samples_pass_the_launchers_own_schemas_and_a_typo_does_not() -> None:
    samples = {name: yaml.safe_load((DEPLOY / name).read_text())["run_launcher"] for name in LAUNCHERS}
    configs = {name: (s["module"], s["class"], s["config"]) for name, s in samples.items()}
    k8s, docker = samples["run_launcher.k8s.yaml"]["config"], samples["run_launcher.docker.yaml"]["config"]
    configs["k8s typo"] = ("dagster_k8s", "K8sRunLauncher", {**k8s, "job_namespce": k8s["job_namespace"]})
    configs["docker typo"] = ("dagster_docker", "DockerRunLauncher", {**docker, "env_var": docker["env_vars"]})
    result = validate_launchers(configs)
    assert result["run_launcher.k8s.yaml"]["ok"], result["run_launcher.k8s.yaml"]
    assert result["run_launcher.docker.yaml"]["ok"], result["run_launcher.docker.yaml"]
    job = result["run_launcher.k8s.yaml"]["job"]
    assert job["claims"] == ["eagle3-data"] and "/data/eagle3" in job["mounts"]
    assert job["password_env"] == [k8s["postgres_password_secret"]]
    assert job["config_maps"] == k8s["env_config_maps"]
    assert not result["k8s typo"]["ok"] and "job_namespce" in " ".join(result["k8s typo"]["errors"])
    assert not result["docker typo"]["ok"] and "env_var" in " ".join(result["docker typo"]["errors"])


def test_the_dagster_family_is_one_release_and_no_library_warns_of_a_mismatch() -> None:
    """dagster-postgres, -k8s and -docker check the dagster they run on at import and warn on a mismatch
    (dagster-postgres 0.29.27 beside dagster 1.13.28 did, in every Dagster process)."""
    from importlib.metadata import version

    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error",
            "-c",
            "import dagster, dagster_webserver, dagster_graphql, dagster_pipes, dagster_postgres, "
            "dagster_k8s, dagster_docker",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    core = {version(p) for p in ["dagster", "dagster-webserver", "dagster-graphql", "dagster-pipes"]}
    libraries = {version(p) for p in ["dagster-postgres", "dagster-k8s", "dagster-docker"]}
    assert len(core) == 1, core
    _, minor, patch = core.pop().split(".")
    assert libraries == {f"0.{int(minor) + 16}.{patch}"}  # Dagster numbers 1.x.y's libraries 0.(x+16).y
