"""The pytest plugin (entry point ``pytest11``, name ``ampguard``).

- ``pytest --ampguard`` runs every test under a fresh guard; ``--ampguard-<option>=VALUE``
  (for example ``--ampguard-trace=eager``) sets the options of every guard the plugin makes.
- ``@pytest.mark.ampguard(**options)`` runs one test under a guard with those options on top.
- The ``amp_guard`` fixture yields the guard of the test (making one if neither of the above did).

Each guard covers the test's set-up, call and teardown and is removed after it, restoring the
state from before the test. When a guarded test fails, its ``Guard.report()`` is added to the
failure report. pytest loads every installed plugin on every run, so this module imports only
pytest: torch, Lightning and ampguard's patching load when a test asks for a guard. Opt out
with ``-p no:ampguard``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# The Guard options, in the order of ampguard._options.SPECS (a test keeps the two in step); listed
# here so that adding the command-line flags imports nothing.
OPTIONS = ("schedulers", "max_consecutive_skips", "check_unscaled_after", "distributed", "closures", "lint",
           "nonfinite", "trace", "devices", "repro_dir", "repro_max_mb")

_options_key = pytest.StashKey[dict]()
_guard_key = pytest.StashKey[Any]()  # the Guard this test runs under
_exit_key = pytest.StashKey[Any]()  # the guard() context the plugin entered for this test
_failed_key = pytest.StashKey[bool]()  # the test itself failed: its exception wins over checks still pending


def _flag(name: str) -> str:
    return "--ampguard-" + name.replace("_", "-")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ampguard", "ampguard: safe mixed-precision training")
    group.addoption("--ampguard", action="store_true", default=False,
                    help="run every test under ampguard.install() (a fresh guard per test, removed after it)")
    for name in OPTIONS:
        group.addoption(_flag(name), dest=f"ampguard_{name}", default=None, metavar="VALUE",
                        help=f"the '{name}' option of every guard the plugin makes, written as AMPGUARD_{name.upper()} "
                             "is (see README.md)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ampguard(**options): run this test under an ampguard guard with these options")
    import os

    if any(k.startswith("AMPGUARD_") for k in os.environ):  # a bad variable: one usage error, not one per test
        from ampguard import ConfigError, _options

        try:
            _options.from_environ(skip={n for n in OPTIONS if config.getoption(f"ampguard_{n}", None) is not None})
        except ConfigError as exc:
            raise pytest.UsageError(str(exc)) from None
    options = {}
    for name in OPTIONS:
        text = config.getoption(f"ampguard_{name}", None)
        if text is not None:
            from ampguard import ConfigError, _options

            try:
                options[name] = _options.parse_text(name, text, f"{_flag(name)}")
            except ConfigError as exc:
                raise pytest.UsageError(str(exc)) from None
    config.stash[_options_key] = options


def _options_for(item: pytest.Item, marker: Any) -> dict:
    options = dict(item.config.stash.get(_options_key, {}))
    if marker is not None:
        if marker.args:
            raise TypeError(f"@pytest.mark.ampguard takes keyword options only, got {marker.args!r}")
        options.update(marker.kwargs)
    return options


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("ampguard")
    if marker is None and not item.config.getoption("ampguard"):
        return  # the cost for every test of every project with ampguard installed: these two lookups
    import ampguard

    context = ampguard.guard(**_options_for(item, marker))
    item.stash[_guard_key] = context.__enter__()
    item.stash[_exit_key] = context


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield  # the test's fixtures are torn down under the guard
    context = item.stash.get(_exit_key, None)
    if context is not None:
        del item.stash[_exit_key]
        if item.stash.get(_failed_key, False):
            context.__exit__(_TestFailed, _TestFailed(), None)  # pending checks are dropped, not raised again
        else:
            context.__exit__(None, None, None)


class _TestFailed(Exception):
    """Stands for the test's own failure when the plugin's guard is left after it."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    g = item.stash.get(_guard_key, None)
    if g is not None and report.failed:
        item.stash[_failed_key] = True
        report.sections.append(("ampguard", g.report()))


@pytest.fixture
def amp_guard(request: pytest.FixtureRequest) -> Iterator[Any]:
    """The ``ampguard.Guard`` this test runs under; the state from before the test is restored after it."""
    import ampguard

    g = request.node.stash.get(_guard_key, None)
    if g is not None and ampguard.active() is g:
        yield g  # --ampguard or the marker made it; their teardown removes it
        return
    with ampguard.guard(**_options_for(request.node, None)) as g:
        request.node.stash[_guard_key] = g
        yield g
