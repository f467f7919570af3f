"""Finding dialects: pluggy plugins behind the ``pipedialect.dialects`` entry-point group.

Every dialect, the built-in ones included, arrives the way a third party's would: an entry point
names a plugin module, the module implements :func:`~pipedialect.hookspecs.register_dialects`,
and the registry records which distribution each dialect came from. Entry points are loaded
once per process, on the first :func:`get_dialect` or :func:`list_dialects`.

- A plugin whose import or registration raises anything, ``SystemExit`` included (only
  ``KeyboardInterrupt`` goes through), is recorded as broken, with its error; the others load
  normally. A plugin is added whole or not at all, and a load that is interrupted is forgotten,
  so the next query loads every plugin again rather than answering from half a registry.
- A dialect whose constructor raises is listed as broken, with the reason; ``pipedialect list``
  creates every dialect to find out (a dialect must be cheap to create).
- Two plugins registering one name is a conflict: :func:`get_dialect` on that name raises
  :class:`~pipedialect.DuplicateDialectError` naming both distributions.
- ``PIPEDIALECT_PLUGINS=a,b`` loads only the entry points named ``a`` and ``b``;
  ``PIPEDIALECT_PLUGINS=`` (empty) loads none.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import threading
import warnings
from typing import Any, Literal

import pluggy

from . import hookspecs
from .contracts import Capability
from .dialect import Dialect, option_descriptions
from .errors import (
    BrokenPluginError,
    DialectNotFoundError,
    DuplicateDialectError,
    PluginError,
    PluginWarning,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "PLUGINS_ENV_VAR",
    "DialectInfo",
    "get_dialect",
    "list_dialects",
    "plugin_manager",
    "register_plugin",
    "reload_plugins",
    "unregister_plugin",
]

logger = logging.getLogger(__name__)

#: The entry-point group dialect plugins are published under.
ENTRY_POINT_GROUP = "pipedialect.dialects"
#: Comma-separated entry-point names to load; unset loads all, empty loads none.
PLUGINS_ENV_VAR = "PIPEDIALECT_PLUGINS"

Status = Literal["ok", "broken", "conflict"]


@dataclasses.dataclass(frozen=True)
class DialectInfo:
    """What ``pipedialect list`` shows for one dialect (or one broken plugin)."""

    #: The dialect's name; for a broken plugin, the plugin's (entry point's) name.
    name: str
    #: The plugin that registered it: the entry point's name, or the in-process name.
    plugin: str
    #: The distribution that provides the plugin, or None when registered in-process.
    distribution: str | None
    #: The dialect's version (falls back to the distribution's), or None if unknown.
    version: str | None
    #: The capabilities the dialect declares.
    capabilities: frozenset[Capability]
    #: ``ok``, ``broken`` (the plugin failed) or ``conflict`` (the name is registered twice).
    status: Status
    #: Why the entry is broken or conflicting; None when ``ok``.
    error: str | None = None
    #: The dialect's one-line description.
    description: str = ""
    #: The ``pipe_engine`` options the dialect adds to the shared arguments: name, type,
    #: default and doc of each (:attr:`Dialect.options`).
    options: tuple[dict[str, Any], ...] = ()
    #: The same for ``runtime_engine`` (:attr:`Dialect.engine_options`).
    engine_options: tuple[dict[str, Any], ...] = ()
    #: The shared ``runtime_engine`` arguments its engine honours (:attr:`Dialect.engine_features`).
    engine_features: frozenset[str] = frozenset()

    def as_dict(self) -> dict[str, Any]:
        """Return a JSON-ready dict (capabilities sorted)."""
        data = dataclasses.asdict(self)
        data["capabilities"] = sorted(str(c) for c in self.capabilities)
        data["options"] = [dict(o) for o in self.options]
        data["engine_options"] = [dict(o) for o in self.engine_options]
        data["engine_features"] = sorted(self.engine_features)
        return data


@dataclasses.dataclass
class _Registered:
    """One registration of a dialect by one plugin."""

    dialect: type[Dialect] | Dialect
    plugin: str
    distribution: str | None
    distribution_version: str | None
    instance: Dialect | None = None
    #: Why the dialect could not be created (its constructor raised), once tried.
    failure: str | None = None

    @property
    def origin(self) -> str:
        """Human-readable provenance: the distribution, or the in-process plugin name."""
        if self.distribution is not None:
            return f"distribution {self.distribution!r} (plugin {self.plugin!r})"
        return f"plugin {self.plugin!r} registered in-process"

    def create(self) -> str | None:
        """Create the dialect instance unless done; return why it cannot be, or None."""
        if self.instance is None and self.failure is None:
            d = self.dialect
            try:
                self.instance = d if isinstance(d, Dialect) else d()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: a dialect never ends the process
                self.failure = f"constructor failed: {type(exc).__name__}: {exc}"
        return self.failure

    def get(self) -> Dialect:
        """Return the dialect instance, creating it on first use.

        Raises:
            BrokenPluginError: the dialect's constructor raised (the message says what).
        """
        failure = self.create()
        if failure is not None or self.instance is None:
            raise BrokenPluginError(
                f"dialect {_dialect_name(self.dialect)!r} from {self.origin} could not be "
                f"created: {failure}"
            )
        return self.instance


class _Registry:
    """The process-wide state: the plugin manager and what each plugin registered."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.loaded = False
        self.loading = False
        self._reset()

    def _reset(self) -> None:
        """Start from no plugins at all."""
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.entries: dict[str, list[_Registered]] = {}
        self.broken: dict[str, DialectInfo] = {}

    # -- loading -------------------------------------------------------------------------

    def ensure_loaded(self) -> None:
        with self.lock:
            if self.loaded or self.loading:
                # Loading already: a plugin's import asked, and sees the plugins before it.
                return
            self.loading = True
            try:
                self._load_entry_points()
            except BaseException:
                # Interrupted (KeyboardInterrupt, an error raised from a warning): forget the
                # half that loaded, so that the next query loads everything again.
                self._reset()
                raise
            finally:
                self.loading = False
            self.loaded = True

    def _load_entry_points(self) -> None:
        wanted = _wanted_plugins()
        eps = sorted(
            importlib.metadata.entry_points(group=ENTRY_POINT_GROUP),
            key=lambda ep: (ep.name, _dist_name(ep) or ""),
        )
        seen: set[str] = set()
        for ep in eps:
            if wanted is not None and ep.name not in wanted:
                continue
            seen.add(ep.name)
            dist, dist_version = _dist_name(ep), _dist_version(ep)
            plugin_name = ep.name
            if self.pm.get_plugin(plugin_name) is not None or plugin_name in self.broken:
                # Two distributions publish an entry point with one name: keep both apart.
                plugin_name = f"{ep.name}@{dist}"
            try:
                plugin = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # SystemExit too: one plugin never ends the process
                self._mark_broken(plugin_name, dist, dist_version, exc, what="import")
                continue
            self._add(plugin, plugin_name, dist, dist_version)
        if wanted is not None:
            for name in sorted(wanted - seen):
                warnings.warn(
                    f"{PLUGINS_ENV_VAR} names {name!r}, but no installed plugin in the "
                    f"{ENTRY_POINT_GROUP!r} entry-point group has that name",
                    PluginWarning,
                    stacklevel=4,
                )

    def _add(self, plugin: object, name: str, dist: str | None, dist_version: str | None) -> None:
        """Register ``plugin`` and the dialects it registers, all of it or (broken) nothing."""
        try:
            self.pm.register(plugin, name=name)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # pluggy validation (bad hook signature, ...)
            self._mark_broken(name, dist, dist_version, exc, what="register")
            return
        found: list[_Registered] = []

        def register(dialect: type[Dialect] | Dialect) -> None:
            _check_dialect(dialect, name)
            found.append(_Registered(dialect, name, dist, dist_version))

        # Call this plugin's hook alone, through pluggy, so its dialects are attributed to it.
        others = [p for n, p in self.pm.list_name_plugin() if n != name]
        only_this = self.pm.subset_hook_caller("register_dialects", remove_plugins=others)
        try:
            only_this(register=register)
        except BaseException as exc:
            self.pm.unregister(name=name)
            if isinstance(exc, KeyboardInterrupt):
                raise
            self._mark_broken(name, dist, dist_version, exc, what="register_dialects")
            return
        for reg in found:
            self.entries.setdefault(_dialect_name(reg.dialect), []).append(reg)
        logger.debug("plugin %s (%s) registered %d dialect(s)", name, dist, len(found))

    def _mark_broken(
        self,
        name: str,
        dist: str | None,
        dist_version: str | None,
        exc: BaseException,
        *,
        what: str,
    ) -> None:
        reason = f"{what} failed: {type(exc).__name__}: {exc}"
        logger.warning("pipedialect plugin %r from %s is broken: %s", name, dist, reason)
        self.broken[name] = DialectInfo(
            name=name,
            plugin=name,
            distribution=dist,
            version=dist_version,
            capabilities=frozenset(),
            status="broken",
            error=reason,
        )

    # -- queries -------------------------------------------------------------------------

    def get(self, name: str) -> Dialect:
        self.ensure_loaded()
        regs = self.entries.get(name)
        if not regs:
            installed = sorted(n for n, r in self.entries.items() if len(r) == 1)
            hint = ", ".join(repr(n) for n in installed) or "none"
            msg = f"no dialect named {name!r}; installed dialects: {hint}"
            broken = sorted(self.broken)
            if broken:
                msg += (
                    f". Broken plugins (run `pipedialect list` for the reasons): "
                    f"{', '.join(broken)}"
                )
            if os.environ.get(PLUGINS_ENV_VAR) is not None:
                msg += f". Note: {PLUGINS_ENV_VAR}={os.environ[PLUGINS_ENV_VAR]!r} limits loading"
            raise DialectNotFoundError(msg)
        if len(regs) > 1:
            raise DuplicateDialectError(_conflict_message(name, regs))
        return regs[0].get()

    def infos(self) -> list[DialectInfo]:
        self.ensure_loaded()
        out: list[DialectInfo] = []
        for name, regs in self.entries.items():
            conflict = _conflict_message(name, regs) if len(regs) > 1 else None
            for reg in regs:
                failure = reg.create()
                d = reg.dialect if reg.instance is None else reg.instance
                status: Status = "conflict" if conflict else "broken" if failure else "ok"
                out.append(
                    DialectInfo(
                        name=name,
                        plugin=reg.plugin,
                        distribution=reg.distribution,
                        version=getattr(d, "version", None) or reg.distribution_version,
                        capabilities=frozenset(getattr(d, "capabilities", frozenset())),
                        status=status,
                        error=conflict or failure,
                        description=getattr(d, "description", ""),
                        **_declared_options(d),
                    )
                )
        out.extend(self.broken.values())
        return sorted(out, key=lambda i: (i.name, i.distribution or "", i.plugin))

    # -- in-process plugins --------------------------------------------------------------

    def register_plugin(self, plugin: object, name: str | None) -> str:
        self.ensure_loaded()
        plugin_name = name or self.pm.get_canonical_name(plugin)
        if self.pm.get_plugin(plugin_name) is not None or plugin_name in self.broken:
            raise PluginError(f"a plugin named {plugin_name!r} is already registered")
        before = len(self.broken)
        self._add(plugin, plugin_name, None, None)
        if len(self.broken) > before and plugin_name in self.broken:
            info = self.broken.pop(plugin_name)
            raise BrokenPluginError(f"plugin {plugin_name!r}: {info.error}")
        return plugin_name

    def unregister_plugin(self, name: str) -> None:
        self.ensure_loaded()
        if self.pm.get_plugin(name) is None:
            raise PluginError(f"no plugin named {name!r} is registered")
        self.pm.unregister(name=name)
        for dialect_name in list(self.entries):
            kept = [r for r in self.entries[dialect_name] if r.plugin != name]
            if kept:
                self.entries[dialect_name] = kept
            else:
                del self.entries[dialect_name]


def _wanted_plugins() -> set[str] | None:
    raw = os.environ.get(PLUGINS_ENV_VAR)
    if raw is None:
        return None
    return {part.strip() for part in raw.split(",") if part.strip()}


def _dist_name(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.name)


def _dist_version(ep: importlib.metadata.EntryPoint) -> str | None:
    dist = getattr(ep, "dist", None)
    return None if dist is None else str(dist.version)


def _dialect_name(dialect: type[Dialect] | Dialect) -> str:
    return str(dialect.name)


def _check_dialect(dialect: object, plugin: str) -> None:
    is_class = isinstance(dialect, type) and issubclass(dialect, Dialect)
    if not (is_class or isinstance(dialect, Dialect)):
        raise PluginError(
            f"plugin {plugin!r} registered {dialect!r}, which is neither a pipedialect.Dialect "
            "subclass nor an instance of one"
        )
    name = getattr(dialect, "name", None)
    if not isinstance(name, str) or not name:
        raise PluginError(
            f"plugin {plugin!r} registered {dialect!r} without a non-empty string `name`"
        )
    cls: type[Dialect] = dialect if isinstance(dialect, type) else type(dialect)
    abstract = sorted(getattr(cls, "__abstractmethods__", ()))
    if abstract:
        missing = ", ".join(abstract)
        raise PluginError(
            f"plugin {plugin!r} registered dialect {name!r} whose class leaves abstract "
            f"methods unimplemented: {missing}"
        )


def _declared_options(dialect: type[Dialect] | Dialect) -> dict[str, Any]:
    """The options a dialect declares, for :class:`DialectInfo`; empty if unreadable."""
    try:
        return {
            "options": tuple(option_descriptions(dialect.options)),
            "engine_options": tuple(option_descriptions(dialect.engine_options)),
            "engine_features": frozenset(dialect.engine_features),
        }
    except Exception:  # a third party's malformed declaration must not break `list`
        logger.debug("cannot describe the options of %r", dialect, exc_info=True)
        return {}


def _conflict_message(name: str, regs: list[_Registered]) -> str:
    origins = " and ".join(r.origin for r in regs)
    return (
        f"dialect name {name!r} is registered twice, by {origins}; uninstall one of them, or "
        f"restrict loading with {PLUGINS_ENV_VAR}"
    )


_registry = _Registry()


def get_dialect(name: str) -> Dialect:
    """Return the installed dialect called ``name``.

    Raises:
        DialectNotFoundError: no dialect has that name; the message lists the installed ones.
        DuplicateDialectError: two plugins register that name; the message names both.
        BrokenPluginError: the dialect's class could not be instantiated (its constructor
            raised; the message gives the error).
    """
    return _registry.get(name)


def list_dialects() -> list[DialectInfo]:
    """Return every registered dialect and every broken plugin, sorted by name.

    Every dialect is created to find out whether it can be: one whose constructor raises is
    listed as ``broken``, with the reason.
    """
    return _registry.infos()


def register_plugin(plugin: object, name: str | None = None) -> str:
    """Register a plugin object in this process (no entry point) and return its name.

    Useful for notebooks and tests; the plugin's dialects appear with no distribution.
    """
    return _registry.register_plugin(plugin, name)


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin` and forget its dialects."""
    _registry.unregister_plugin(name)


def plugin_manager() -> pluggy.PluginManager:
    """Return the process-wide pluggy plugin manager (entry points loaded)."""
    _registry.ensure_loaded()
    return _registry.pm


def reload_plugins() -> None:
    """Forget every plugin and load the entry points again on next use.

    Needed after installing or removing a plugin distribution in a running process.
    """
    global _registry
    importlib.invalidate_caches()
    _registry = _Registry()
