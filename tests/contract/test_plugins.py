"""The dialect registry, exercised with real plugin distributions installed by pip.

The distributions under tests/plugins/ are pip-installed into separate target directories once
per session; each check runs in a fresh interpreter whose PYTHONPATH names the plugins it
should see, so entry points are discovered exactly as in a user's environment.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _fresh import fresh_env

import pipedialect
from pipedialect import plugins

HERE = Path(__file__).resolve().parents[1]
PLUGIN_SOURCES = HERE / "plugins"


@pytest.fixture(scope="session")
def installed_plugins(install_plugin: Callable[[Path], Path]) -> dict[str, Path]:
    """Each test plugin distribution, pip-installed into its own target directory."""
    names = ("toy", "toy_fork", "broken", "exits", "badinit")
    return {name: install_plugin(PLUGIN_SOURCES / name) for name in names}


def run_python(
    code: str,
    plugin_dirs: list[Path] = (),  # type: ignore[assignment]
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter that sees the given plugin directories."""
    full_env = fresh_env(plugin_dirs, env)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"subprocess failed:\n{proc.stdout}\n{proc.stderr}")
    return proc


def cli_list_json(plugin_dirs: list[Path], env: dict[str, str] | None = None) -> list[dict]:
    proc = run_python(
        "import sys; from pipedialect.cli import main; sys.exit(main(['list', '--json']))",
        plugin_dirs,
        env,
    )
    return json.loads(proc.stdout)


def test_builtin_dialects_register_through_entry_points() -> None:
    infos = {i.name: i for i in pipedialect.list_dialects()}
    for name in ("deepspeed", "local"):
        assert infos[name].distribution == "pipedialect"
        assert infos[name].plugin == name
        assert infos[name].status == "ok"
        assert infos[name].version == pipedialect.__version__
    assert pipedialect.Capability.TIED_WEIGHTS in infos["deepspeed"].capabilities
    assert pipedialect.get_dialect("local").name == "local"


@pytest.mark.distributed
def test_importing_never_imports_deepspeed() -> None:
    proc = run_python(
        """
        import sys
        import pipedialect
        import pipedialect.dialects.deepspeed
        import pipedialect.dialects.local
        d = pipedialect.get_dialect("deepspeed")
        pipedialect.list_dialects()
        print(d.name, "deepspeed" in sys.modules)
        """
    )
    assert proc.stdout.split() == ["deepspeed", "False"]


@pytest.mark.distributed
def test_third_party_plugin_is_found_and_listed(installed_plugins: dict[str, Path]) -> None:
    proc = run_python(
        """
        import pipedialect
        d = pipedialect.get_dialect("toy")
        print(type(d).__module__, type(d).__name__, d.version)
        """,
        [installed_plugins["toy"]],
    )
    assert proc.stdout.split() == ["pipedialect_toy", "ToyDialect", "1.2.3"]
    listed = {d["name"]: d for d in cli_list_json([installed_plugins["toy"]])}
    assert listed["toy"] == {
        "name": "toy",
        "plugin": "toy",
        "distribution": "pipedialect-toy",
        "version": "1.2.3",
        "capabilities": ["tied-weights"],
        "status": "ok",
        "error": None,
        "description": "registry test dialect",
        # a dialect that declares no options of its own
        "options": [],
        "engine_options": [],
        "engine_features": [],
    }
    assert {"deepspeed", "local", "toy"} <= set(listed)


@pytest.mark.distributed
def test_broken_plugin_is_listed_and_does_not_break_others(
    installed_plugins: dict[str, Path],
) -> None:
    dirs = [installed_plugins["toy"], installed_plugins["broken"]]
    listed = {d["name"]: d for d in cli_list_json(dirs)}
    assert listed["broken"]["status"] == "broken"
    assert listed["broken"]["distribution"] == "pipedialect-broken"
    assert "libfancycomm.so" in listed["broken"]["error"]
    assert "ImportError" in listed["broken"]["error"]
    assert listed["toy"]["status"] == "ok"
    assert listed["local"]["status"] == "ok"
    proc = run_python(
        """
        import pipedialect
        print(pipedialect.get_dialect("toy").name, pipedialect.get_dialect("local").name)
        try:
            pipedialect.get_dialect("nope")
        except pipedialect.DialectNotFoundError as e:
            print(e)
        """,
        dirs,
    )
    first, message = proc.stdout.splitlines()
    assert first == "toy local"
    assert "'nope'" in message and "'toy'" in message and "broken" in message
    table = run_python(
        "import sys; from pipedialect.cli import main; sys.exit(main(['list']))", dirs
    ).stdout
    assert "broken" in table and "libfancycomm.so" in table


@pytest.mark.distributed
def test_two_dialects_with_one_name_name_both_distributions(
    installed_plugins: dict[str, Path],
) -> None:
    dirs = [installed_plugins["toy"], installed_plugins["toy_fork"]]
    proc = run_python(
        """
        import pipedialect
        try:
            pipedialect.get_dialect("toy")
        except pipedialect.DuplicateDialectError as e:
            print("DUP", e)
        print(pipedialect.get_dialect("local").name)
        """,
        dirs,
    )
    dup, local = proc.stdout.splitlines()
    assert dup.startswith("DUP ")
    assert "'pipedialect-toy'" in dup and "'pipedialect-toy-fork'" in dup
    assert local == "local"
    toys = [d for d in cli_list_json(dirs) if d["name"] == "toy"]
    assert sorted(d["distribution"] for d in toys) == ["pipedialect-toy", "pipedialect-toy-fork"]
    assert {d["status"] for d in toys} == {"conflict"}


def test_unknown_name_lists_installed_dialects() -> None:
    with pytest.raises(pipedialect.DialectNotFoundError) as info:
        pipedialect.get_dialect("megatron")
    message = str(info.value)
    assert "'megatron'" in message and "'deepspeed'" in message and "'local'" in message
    assert isinstance(info.value, pipedialect.PipeDialectError)


@pytest.mark.distributed
def test_env_var_limits_which_plugins_load(installed_plugins: dict[str, Path]) -> None:
    dirs = [installed_plugins["toy"], installed_plugins["broken"]]
    names = {d["name"] for d in cli_list_json(dirs, {"PIPEDIALECT_PLUGINS": "toy, local"})}
    assert names == {"toy", "local"}
    assert cli_list_json(dirs, {"PIPEDIALECT_PLUGINS": ""}) == []
    proc = run_python(
        """
        import warnings, pipedialect
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            names = [i.name for i in pipedialect.list_dialects()]
        print(names, [type(w.message).__name__ for w in caught], caught[0].message)
        try:
            pipedialect.get_dialect("deepspeed")
        except pipedialect.DialectNotFoundError as e:
            print(e)
        """,
        dirs,
        {"PIPEDIALECT_PLUGINS": "local,nosuch"},
    )
    listing, not_found = proc.stdout.splitlines()
    assert listing.startswith("['local'] ['PluginWarning']") and "'nosuch'" in listing
    assert "PIPEDIALECT_PLUGINS='local,nosuch'" in not_found


class _InProcessDialect(pipedialect.Dialect):
    name = "inproc"
    version = "7"

    def _build_pipeline(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def _build_engine(self, request):  # type: ignore[no-untyped-def]
        raise NotImplementedError


class _GoodPlugin:
    @pipedialect.hookimpl
    def register_dialects(self, register):  # type: ignore[no-untyped-def]
        register(_InProcessDialect)


class _BadPlugin:
    @pipedialect.hookimpl
    def register_dialects(self, register):  # type: ignore[no-untyped-def]
        register(object)


def test_in_process_registration_round_trip() -> None:
    name = plugins.register_plugin(_GoodPlugin(), name="inproc-plugin")
    try:
        dialect = pipedialect.get_dialect("inproc")
        assert isinstance(dialect, _InProcessDialect)
        assert dialect is pipedialect.get_dialect("inproc")  # created once
        info = next(i for i in pipedialect.list_dialects() if i.name == "inproc")
        assert (info.distribution, info.plugin, info.version) == (None, "inproc-plugin", "7")
    finally:
        plugins.unregister_plugin(name)
    with pytest.raises(pipedialect.DialectNotFoundError):
        pipedialect.get_dialect("inproc")


def test_registering_a_non_dialect_is_refused() -> None:
    with pytest.raises(pipedialect.BrokenPluginError, match=r"neither a pipedialect\.Dialect"):
        plugins.register_plugin(_BadPlugin(), name="bad-plugin")
    assert "bad-plugin" not in {i.plugin for i in pipedialect.list_dialects()}


@pytest.mark.distributed
def test_a_plugin_raising_system_exit_is_broken_and_the_others_load(
    installed_plugins: dict[str, Path],
) -> None:
    """``sys.exit`` at import or inside the hook makes that plugin broken, nothing more: the
    plugins after it (local, torch) still load, and a hook that registered a dialect before
    exiting leaves none behind."""
    dirs = [installed_plugins["exits"]]
    listed = {d["name"]: d for d in cli_list_json(dirs)}
    assert listed["exits"]["status"] == "broken"
    assert listed["exits"]["error"] == "import failed: SystemExit: 3"
    assert listed["exits_midway"]["status"] == "broken"
    assert listed["exits_midway"]["error"] == "register_dialects failed: SystemExit: no GPU here"
    assert "midway" not in listed
    assert {listed[n]["status"] for n in ("deepspeed", "local", "torch")} == {"ok"}
    table = run_python(
        "import sys; from pipedialect.cli import main; sys.exit(main(['list']))", dirs
    ).stdout
    assert "exits (broken): import failed: SystemExit: 3" in table
    proc = run_python(
        """
        import pipedialect
        print(len(pipedialect.list_dialects()))
        print(pipedialect.get_dialect("local").name, pipedialect.get_dialect("torch").name)
        try:
            pipedialect.get_dialect("midway")
        except pipedialect.DialectNotFoundError as e:
            print(e)
        """,
        dirs,
    )
    count, names, missing = proc.stdout.splitlines()
    assert int(count) == len(listed)
    assert names == "local torch"
    assert "no dialect named 'midway'" in missing and "exits, exits_midway" in missing


@pytest.mark.distributed
def test_a_dialect_whose_constructor_raises_is_listed_broken(
    installed_plugins: dict[str, Path],
) -> None:
    dirs = [installed_plugins["badinit"]]
    listed = {d["name"]: d for d in cli_list_json(dirs)}
    assert listed["needs-gpu"]["status"] == "broken"
    assert listed["needs-gpu"]["error"] == (
        "constructor failed: RuntimeError: no CUDA device: the needs-gpu dialect requires one"
    )
    assert listed["needs-gpu"]["distribution"] == "pipedialect-badinit"
    assert listed["needs-gpu"]["capabilities"] == ["multi-process"]
    assert listed["quits"]["status"] == "broken"
    assert listed["quits"]["error"] == "constructor failed: SystemExit: 4"
    assert listed["fine"]["status"] == "ok" and listed["local"]["status"] == "ok"
    proc = run_python(
        """
        import pipedialect
        for name in ("needs-gpu", "quits"):
            try:
                pipedialect.get_dialect(name)
            except pipedialect.BrokenPluginError as e:
                print(e)
        print(pipedialect.get_dialect("fine").name)
        """,
        dirs,
    )
    needs_gpu, quits, fine = proc.stdout.splitlines()
    assert needs_gpu == (
        "dialect 'needs-gpu' from distribution 'pipedialect-badinit' (plugin 'badinit') could "
        "not be created: constructor failed: RuntimeError: no CUDA device: the needs-gpu "
        "dialect requires one"
    )
    assert quits.endswith("could not be created: constructor failed: SystemExit: 4")
    assert fine == "fine"


class _EntryPoint:
    """Just what the registry reads of an ``importlib.metadata.EntryPoint``."""

    def __init__(self, name: str, load: Any) -> None:
        self.name = name
        self.dist = None
        self._load = load

    def load(self) -> Any:
        return self._load()


def test_an_interrupted_load_is_forgotten_not_half_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a plugin imports goes through, and the next query loads every plugin."""
    import pipedialect.dialects.local as local_plugin

    def interrupted() -> Any:
        raise KeyboardInterrupt

    eps = [_EntryPoint("alocal", lambda: local_plugin), _EntryPoint("b", interrupted)]
    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: eps)
    registry = plugins._Registry()
    with pytest.raises(KeyboardInterrupt):
        registry.infos()
    assert not registry.loaded and not registry.entries and not registry.broken
    assert registry.pm.get_plugin("alocal") is None
    eps[1] = _EntryPoint("b", lambda: _GoodPlugin())
    assert {i.name: i.status for i in registry.infos()} == {"local": "ok", "inproc": "ok"}
