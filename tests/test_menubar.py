"""The menu-bar app's macOS behaviour, run on Linux through fake `rumps`/AppKit modules
(`support.menubar`): the accessory activation policy, windows brought to the front and made
key, the status timer in the common run-loop modes, the loading text shown before a load that may
compile for the Neural Engine, and a quit that stops the model's threads and returns from the
event loop instead of ending in C exit()."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import menubar as fakes

from ondevice.apps.chat_controller import ChatController, ChatState


@pytest.fixture
def menubar(monkeypatch, tmp_path):
    module = fakes.install(monkeypatch)
    monkeypatch.setattr(module, "history_path", lambda: tmp_path / "history.json")
    monkeypatch.setattr(module, "installed_bundles", lambda: [])
    return module


def names() -> list[str]:
    return [name for name, _ in fakes.calls]


def test_main_makes_an_accessory_app_and_returns_after_the_event_loop(menubar, pair):
    assert menubar.main([str(pair[0])]) == 0
    order = names()
    policy = fakes.calls[order.index("setActivationPolicy_")]
    assert policy[1] == ("NSApplicationActivationPolicyAccessory",)
    assert order.index("setActivationPolicy_") < order.index("App.run")


def test_the_timer_runs_in_the_common_modes_and_loading_is_announced_first(menubar, pair):
    ctrl = ChatController()
    seen = {}
    real_load = ctrl.load

    def load(model, **kw):
        seen["status"] = (app.status_item.title, app.status_item.hidden, app.title)
        return real_load(model, **kw)

    ctrl.load = load  # type: ignore[method-assign]
    app = menubar.MenuBarApp.__new__(menubar.MenuBarApp)
    menubar.MenuBarApp.__init__(app, ctrl, model=str(pair[0]))
    added = [args for name, args in fakes.calls if name == "addTimer_forMode_"]
    assert added and added[0][0] is app.timer._nstimer
    assert added[0][1]._name == "NSRunLoopCommonModes" and app.timer.running
    text, hidden, title = seen["status"]
    assert "compiling for the Neural Engine" in text and "first time only" in text
    assert not hidden and title == menubar.TITLES[ChatState.LOADING]
    ctrl.wait()
    app.poll(None)
    assert app.status_item.hidden  # gone once the load ended
    ctrl.close()


class StubController:
    busy = False
    state = ChatState.IDLE
    error = None
    model_name = None
    saved_model = None
    system_prompt = ""
    answer = ""
    messages: list = []
    last_stats = None

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send(self, text: str) -> bool:
        self.sent.append(text)
        return False

    def set_system_prompt(self, text: str) -> None:
        self.system_prompt = text

    def drain(self) -> list:
        return []

    def live_stats(self):  # type: ignore[no-untyped-def]
        return None


@pytest.mark.parametrize("action", ["ask", "edit_system_prompt"])
def test_windows_open_in_front_and_take_the_keyboard(menubar, action):
    ctrl = StubController()
    app = menubar.MenuBarApp(ctrl)
    fakes.calls.clear()
    fakes.Window.answers = [fakes.Response(1, "hello")]
    getattr(app, action)(None)
    order = names()
    assert order.index("activateIgnoringOtherApps_") < order.index("Window.run")
    assert order.index("makeKeyAndOrderFront_") < order.index("Window.run")
    assert ctrl.sent == ["hello"] or ctrl.system_prompt == "hello"


def test_quit_stops_the_models_threads_and_ends_the_event_loop(menubar, pair, tmp_path):
    ctrl = ChatController(history_path=tmp_path / "h.json")
    app = menubar.MenuBarApp(ctrl, model=str(pair[0]))
    ctrl.wait()
    assert ctrl.send("hi")
    ctrl.wait()
    worker = ctrl._gen._worker._thread  # the model's generation thread
    assert worker.is_alive()
    app.quit(None)  # the fake rumps.quit_application raises: it must not be called
    assert "stopEventLoop" in names() and not app.timer.running
    assert not worker.is_alive() and ctrl._gen is None
    assert Path(tmp_path / "h.json").exists()  # the conversation was saved
