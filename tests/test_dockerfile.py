"""The Dockerfile at the repository root, read and checked against the project without a container engine.

Its build is not part of the suite; what can be known from the file is
checked: the base image, the wheel built from this checkout with the serve
extra, the user, the port, the command (parsed by `tmt serve`'s own options)
and the health check's path (answered by the app).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def exec_form(arguments: str) -> list[str]:
    """The JSON array of an exec-form ENTRYPOINT, CMD or HEALTHCHECK CMD (the shell form is refused: SIGTERM
    would reach a shell, not the server)."""
    assert arguments.startswith("["), f"not the exec form: {arguments}"
    return json.loads(arguments)


@pytest.fixture(scope="module")
def stages() -> list[list[tuple[str, str]]]:
    """The instructions of each build stage, in order."""
    found: list[list[tuple[str, str]]] = []
    for word, rest in instructions((ROOT / "Dockerfile").read_text()):
        if word == "FROM":
            found.append([])
        found[-1].append((word, rest))
    return found


@pytest.fixture(scope="module")
def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_the_base_image_is_a_slim_python_the_project_runs_on(stages, project) -> None:
    minimum = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", project["requires-python"]).groups())
    for stage in stages:
        image = stage[0][1].split()[0]
        match = re.fullmatch(r"python:(\d+)\.(\d+)-slim(-\w+)?", image)
        assert match and tuple(map(int, match.groups()[:2])) >= minimum, image


def test_the_wheel_is_built_from_this_checkout_and_installed_with_the_serve_extra(stages, project) -> None:
    build, final = stages[0], stages[-1]
    copied = [rest.split()[0] for word, rest in build if word == "COPY"]
    assert "pyproject.toml" in copied and "transformer_mt" in copied
    assert any(word == "RUN" and "pip wheel" in rest and rest.endswith(" .") for word, rest in build)
    runs = [rest for word, rest in final if word == "RUN"]
    torch = next(i for i, rest in enumerate(runs) if "torch==" in rest)
    assert "--index-url https://download.pytorch.org/whl/cpu" in runs[torch]
    wheel = next(i for i, rest in enumerate(runs) if ".whl" in rest)
    assert torch < wheel and "[serve]" in runs[wheel] and "serve" in project["optional-dependencies"]
    assert re.search(r"transformer_mt-\*\.whl", runs[wheel]) and project["name"] == "transformer_mt"
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    for path in ("pyproject.toml", "README.md", "transformer_mt"):  # what the build copies gets to the builder
        assert any(line.rstrip("/") == f"!{path}" for line in ignored), path
    assert project["readme"] == "README.md"


def test_the_server_runs_as_a_user_without_privileges(stages) -> None:
    final = stages[-1]
    users = [rest for word, rest in final if word == "USER"]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith("0:")
    made = [i for i, (word, rest) in enumerate(final) if word == "RUN" and "useradd" in rest and users[-1] in rest]
    assert made and made[0] < final.index(("USER", users[-1]))


def test_the_command_is_tmt_serve_on_the_exposed_port(stages, project) -> None:
    import typer.main

    from transformer_mt.cli import app

    final = stages[-1]
    entry = exec_form(next(rest for word, rest in final if word == "ENTRYPOINT"))
    cmd = exec_form(next(rest for word, rest in final if word == "CMD"))
    assert entry[:2] == ["tmt", "serve"] and entry[0] in project["scripts"]
    args = entry[2:] + cmd
    assert args[args.index("--host") + 1] == "0.0.0.0"
    exposed = [rest for word, rest in final if word == "EXPOSE"]
    assert exposed == [args[args.index("--port") + 1]]
    serve = typer.main.get_command(app).commands["serve"]
    with serve.make_context("serve", list(args)) as ctx:  # every option is tmt serve's, with a valid value
        assert ctx.params["port"] == int(exposed[0]) and ctx.params["host"] == "0.0.0.0"


def test_the_health_check_asks_the_apps_health_route(stages, toy_ckpt: Path) -> None:
    from starlette.testclient import TestClient

    from transformer_mt.decode.translate import Translator
    from transformer_mt.serve.app import ServerInfo, build_app
    from transformer_mt.serve.batcher import Batcher
    from transformer_mt.serve.protocol import Limits

    final = stages[-1]
    check = next(rest for word, rest in final if word == "HEALTHCHECK")
    command = exec_form(check[check.index(" CMD ") + 5 :].strip())
    url = re.search(r"http://127\.0\.0\.1:(\d+)(/\w*)", shlex.join(command))
    exposed = next(rest for word, rest in final if word == "EXPOSE")
    assert url and url.group(1) == exposed and command[0] == "python"  # the image has python, not curl
    translator = Translator.from_checkpoints([toy_ckpt], device="cpu")
    batcher = Batcher(translator, max_batch_tokens=1000, max_wait_ms=5, queue_size=4)
    with TestClient(build_app(batcher, ServerInfo("toy.pt", "pytorch", "cpu", "none"), Limits())) as client:
        answer = client.get(url.group(2))
    assert answer.status_code == 200 and answer.json()["status"] == "ok"
