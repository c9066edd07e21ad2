"""The environment horovodrun forwards to ranks carries no credentials."""

import pytest

from appliance.cluster import Cluster, Node
from appliance.spec import parse_spec
from appliance.protocol import denied_names, is_denied, rank_environment
from appliance.train.launch import horovodrun_command

SECRETS = {
    "OS_PASSWORD": "hunter2-pw", "OS_APPLICATION_CREDENTIAL_SECRET": "s3cr3t-appcred", "OS_TOKEN": "tok-8812",
    "AWS_SECRET_ACCESS_KEY": "aws-secret-77", "AWS_ACCESS_KEY_ID": "AKIA4242", "GITHUB_TOKEN": "ghp-1234",
    "DB_PASSWORD": "db-pw-99", "MY_SECRET": "my-secret-55", "ST_KEY": "swiftkey-31",
}


@pytest.mark.parametrize("name", sorted(SECRETS))
def test_deny_list(name):
    assert is_denied(name)


@pytest.mark.parametrize("name", ["PATH", "HOME", "LANG", "TF_USE_LEGACY_KERAS", "GLOO_SOCKET_IFNAME", "EPOCHS"])
def test_allowed(name):
    assert not is_denied(name)


def test_rank_environment_is_built_from_an_allow_list():
    launcher = {**SECRETS, "LANG": "en_US.UTF-8", "SOMETHING_ELSE": "1", "PATH": "/evil"}
    env = rank_environment(path="/venv/bin:/usr/bin", home="/root", nic="eth0", launcher_env=launcher)
    assert not denied_names(env)
    assert "SOMETHING_ELSE" not in env
    assert env["PATH"] == "/venv/bin:/usr/bin"
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["TF_USE_LEGACY_KERAS"] == "1"


def test_rank_environment_refuses_credentials_in_extra():
    with pytest.raises(ValueError, match="OS_PASSWORD"):
        rank_environment(path="/usr/bin", home="/root", nic="eth0", extra={"OS_PASSWORD": "x"})


def test_horovodrun_command_scrubs_the_launcher_environment(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    spec = parse_spec({"name": "t", "train": {"command": "python train.py --lr 0.1", "env": {"EPOCHS": "3"}}},
                      path="/x/t.yaml")
    cl = Cluster(name="c", cloud="testbed", python="/venv/bin/python", nodes=[
        Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/mnt/local"),
        Node(name="node2", private_ip="10.0.0.2", address="10.0.0.2", workdir="/mnt/local")])
    cmd, env = horovodrun_command(cl, spec, job_id="j1", nic="eth0", pkg_dir="/pkg")
    assert not denied_names(env)
    for value in SECRETS.values():
        assert value not in cmd
    assert "env -i " in cmd and "-H node1:1,node2:1" in cmd and "--network-interface eth0" in cmd
    assert "--start-timeout 60" in cmd and env["EPOCHS"] == "3" and env["APPLIANCE_JOB_ID"] == "j1"
    assert env["PATH"].startswith("/mnt/local/appliance/etc/bin:/venv/bin:")
    assert " /venv/bin/python -m appliance.node.hvdrun -np 2 " in cmd and " --gloo " in cmd


def test_the_local_clouds_ranks_wake_horovods_loop_less_often_unless_the_spec_says():
    """The local cloud's nodes (and the local testbed's) share one machine's cores: their ranks run Horovod's
    background loop at 10 ms, not the 1 ms default (Site.rank_env); a spec's train.env wins. It goes by where the
    cluster is, not by the spec's `cloud:`: ranks on Chameleon, or on a Heat head node's own cluster, keep Horovod's
    default even when the spec leaves `cloud:` at local."""
    def env_of(cloud, train_env):
        spec = parse_spec({"name": "t", "train": {"command": "python train.py", "env": train_env}}, path="/x/t.yaml")
        cl = Cluster(name="c", cloud=cloud, python="/venv/bin/python", nodes=[
            Node(name="node1", private_ip="10.0.0.1", address="10.0.0.1", workdir="/mnt/local")])
        return horovodrun_command(cl, spec, job_id="j1", nic="eth0", pkg_dir="/pkg")[1]

    assert env_of("testbed", {})["HOROVOD_CYCLE_TIME"] == env_of("local", {})["HOROVOD_CYCLE_TIME"] == "10"
    assert env_of("local", {"HOROVOD_CYCLE_TIME": "1"})["HOROVOD_CYCLE_TIME"] == "1"
    assert "HOROVOD_CYCLE_TIME" not in env_of("chameleon", {})
    assert "HOROVOD_CYCLE_TIME" not in env_of("node", {})


def test_the_launch_is_horovodrun_without_its_per_launch_build_probe(monkeypatch):
    """horovodrun --gloo imported TensorFlow in a forked process at every launch to ask whether Horovod has Gloo
    (horovod.common.util.gloo_built): 4 s of each job's start here. appliance.node.hvdrun answers it (the doctor
    checks the build) and runs horovodrun's own entry point with the same arguments."""
    import sys

    from horovod.runner import launch

    from appliance.node import hvdrun

    seen = {}
    monkeypatch.setattr(launch, "gloo_built", launch.gloo_built)  # put back after the test
    monkeypatch.setattr(launch, "run_commandline", lambda: seen.update(gloo=launch.gloo_built(), prog=sys.argv[0],
                                                                       args=sys.argv[1:]))
    monkeypatch.setattr(sys, "argv", ["/venv/lib/python3.11/site-packages/appliance/node/hvdrun.py", "-np", "2",
                                      "--gloo", "true"])
    hvdrun.main()
    assert seen == {"gloo": True, "prog": "horovodrun", "args": ["-np", "2", "--gloo", "true"]}


@pytest.mark.parametrize("error", ["Horovod detected that one or more processes exited with non-zero status, thus "
                                   "causing the job to be terminated. The first process to do so was:\nProcess name: "
                                   "0\nExit code: 75\n", "something else"])
def test_a_rank_that_exits_non_zero_ends_horovodrun_without_a_traceback(monkeypatch, capsys, error):
    """A level-3 job stopped with its files committed ends rank 0 with 75, and horovodrun's RuntimeError about it
    came out as a Python traceback under the job's output: its lines now, exit 1 as before; any other error is
    horovodrun's as it was."""
    import sys

    from horovod.runner import launch

    from appliance.node import hvdrun

    def fail():
        raise RuntimeError(error)

    monkeypatch.setattr(launch, "run_commandline", fail)
    monkeypatch.setattr(sys, "argv", ["hvdrun.py", "-np", "1", "true"])
    if error == "something else":
        with pytest.raises(RuntimeError, match="something else"):
            hvdrun.main()
        return
    with pytest.raises(SystemExit) as ex:
        hvdrun.main()
    assert ex.value.code == 1
    assert capsys.readouterr().err.splitlines()[-2:] == ["Process name: 0", "Exit code: 75"]
