"""Fake `rumps`, `AppKit` and `PyObjCTools` modules, so that `ondevice.apps.menubar` imports and
runs on Linux. Every AppKit call is recorded in `calls` as (method name, args); rumps' classes
keep just the state the app touches (titles, callbacks, hidden flags, timers, windows)."""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

calls: list[tuple[str, tuple]] = []


class Recorder:
    """Any AppKit object: attribute access gives another recorder, calls are logged."""

    def __init__(self, name: str = "") -> None:
        self._name = name

    def __getattr__(self, name: str) -> Recorder:
        if name.startswith("__"):
            raise AttributeError(name)
        return Recorder(name)

    def __call__(self, *args: Any, **kwargs: Any) -> Recorder:
        calls.append((self._name, args))
        return Recorder(self._name)

    def __or__(self, other: Any) -> Recorder:
        return self


class AppKit(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Recorder(name) if not name.startswith("NSApplicationActivationPolicy") else name


class MenuItem:
    def __init__(self, title: str = "", callback=None, key=None) -> None:  # type: ignore[no-untyped-def]
        self.title, self.callback, self.state = title, callback, 0
        self._menu: list | None = None
        self.hidden = False
        item = self

        class _NSMenuItem:
            def setHidden_(self, hidden: bool) -> None:
                item.hidden = hidden

        self._menuitem = _NSMenuItem()

    def set_callback(self, callback) -> None:  # type: ignore[no-untyped-def]
        self.callback = callback

    def add(self, item) -> None:  # type: ignore[no-untyped-def]
        self._menu = (self._menu or []) + [item]

    def clear(self) -> None:
        self._menu = []


class Timer:
    def __init__(self, callback, interval: float) -> None:  # type: ignore[no-untyped-def]
        self.callback, self.interval, self.running = callback, interval, False

    def start(self) -> None:
        self.running = True
        self._nstimer = Recorder("NSTimer")

    def stop(self) -> None:
        self.running = False


class Response:
    def __init__(self, clicked: int, text: str) -> None:
        self.clicked, self.text = clicked, text


class Window:
    answers: list[Response] = []  # what the next windows return
    shown: list[Window] = []

    def __init__(self, message: str = "", title: str = "", **kwargs: Any) -> None:
        self.message = message
        self._alert = Recorder("NSAlert")

    def run(self) -> Response:
        Window.shown.append(self)
        calls.append(("Window.run", (self.message,)))
        return Window.answers.pop(0) if Window.answers else Response(0, "")


class App:
    def __init__(self, name: str, title: str | None = None, quit_button=None) -> None:  # type: ignore[no-untyped-def]
        self.name, self.title, self.menu = name, title, []

    def run(self) -> None:
        calls.append(("App.run", ()))


def quit_application() -> None:
    raise AssertionError("rumps.quit_application ends in C exit(); the app must not call it")


def alert(*args: Any) -> None:
    calls.append(("alert", args))


def install(monkeypatch) -> types.ModuleType:
    """The fakes in sys.modules, and the menubar module imported afresh as on macOS (sys.platform
    is 'darwin' only while it imports: the rest of the process stays this platform's)."""
    calls.clear()
    Window.answers, Window.shown = [], []
    rumps = types.ModuleType("rumps")
    for obj in (MenuItem, Timer, Window, App, quit_application, alert):
        setattr(rumps, obj.__name__, obj)
    helper = types.ModuleType("PyObjCTools.AppHelper")
    helper.stopEventLoop = lambda: calls.append(("stopEventLoop", ()))  # type: ignore[attr-defined]
    tools = types.ModuleType("PyObjCTools")
    tools.AppHelper = helper  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "rumps", rumps)
    monkeypatch.setitem(sys.modules, "AppKit", AppKit("AppKit"))
    monkeypatch.setitem(sys.modules, "PyObjCTools", tools)
    monkeypatch.setitem(sys.modules, "PyObjCTools.AppHelper", helper)
    # The module imported as on macOS must leave sys.modules and its package when the test ends,
    # so that a later `import ondevice.apps.menubar` fails off macOS as it should: setting a
    # placeholder through monkeypatch records the entry's absence, which the undo restores.
    apps = importlib.import_module("ondevice.apps")
    monkeypatch.setitem(sys.modules, "ondevice.apps.menubar", None)
    monkeypatch.setattr(apps, "menubar", None, raising=False)
    del sys.modules["ondevice.apps.menubar"]
    with monkeypatch.context() as m:
        m.setattr(sys, "platform", "darwin")
        return importlib.import_module("ondevice.apps.menubar")
