"""`ondevice-menubar`: a macOS menu-bar chat, a thin rumps shell over `ChatController`.

All behaviour (history, streaming, stop, model switching, persistence, errors, statistics) lives
in `ondevice.apps.chat_controller.ChatController`, which is tested on Linux. This module only draws: the
status item, menus, the prompt window (rumps) and the streaming answer panel (AppKit through
PyObjC, as rumps has no text panel). Generation and loading run in the controller's worker
thread; a `rumps.Timer` on the main thread drains the controller's event queue, so every UI
update happens on the main thread.

Nothing else in the package imports this module; it refuses to import off macOS.
"""

from __future__ import annotations

import argparse
import sys

if sys.platform != "darwin":
    raise ImportError(
        "ondevice.apps.menubar is the macOS menu-bar app and runs only on macOS. "
        "On this system use `ondevice chat` (terminal) or `ondevice serve` (HTTP API)."
    )

try:
    import rumps
    from AppKit import (
        NSApplication,
        NSApplicationActivationPolicyAccessory,
        NSBackingStoreBuffered,
        NSFont,
        NSMakeRect,
        NSMakeSize,
        NSPanel,
        NSPasteboard,
        NSPasteboardTypeString,
        NSRunLoop,
        NSRunLoopCommonModes,
        NSScrollView,
        NSTextView,
        NSViewHeightSizable,
        NSViewWidthSizable,
        NSWindowStyleMaskClosable,
        NSWindowStyleMaskResizable,
        NSWindowStyleMaskTitled,
        NSWindowStyleMaskUtilityWindow,
    )
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the menu-bar app needs rumps and PyObjC ({e}); install them with "
        "`pip install 'ondevice[app]'`."
    ) from e

from pathlib import Path

from ondevice.apps.chat_controller import ChatController, ChatState
from ondevice.apps.formatting import format_limits, format_stats
from ondevice.apps.installed import InstalledModel, installed_bundles
from ondevice.sources.sizes import human_size

TITLES = {  # the status item's text for each controller state
    ChatState.IDLE: "◯",
    ChatState.LOADING: "◌",
    ChatState.GENERATING: "●",
    ChatState.STOPPING: "◍",
}
POLL_SECONDS = 0.1
# shown before a load, which may compile the draft for the Neural Engine: coremltools holds the
# GIL through compile and load, so nothing on screen can change until it finishes
LOADING_TEXT = "Loading {name}… (compiling for the Neural Engine the first time only)"


def history_path() -> Path:
    """~/Library/Application Support/ondevice/history.json"""
    from platformdirs import user_data_dir

    return Path(user_data_dir("ondevice", appauthor=False)) / "history.json"


class AnswerPanel:
    """A floating, resizable panel with a read-only text view that follows the answer."""

    def __init__(self) -> None:
        style = (
            NSWindowStyleMaskTitled
            | NSWindowStyleMaskClosable
            | NSWindowStyleMaskResizable
            | NSWindowStyleMaskUtilityWindow
        )
        frame = NSMakeRect(0, 0, 560, 400)
        self.panel = NSPanel.alloc().initWithContentRect_styleMask_backing_defer_(
            frame, style, NSBackingStoreBuffered, False
        )
        self.panel.setTitle_("ondevice")
        self.panel.setReleasedWhenClosed_(False)  # closing hides it; we show it again later
        self.panel.setHidesOnDeactivate_(False)
        scroll = NSScrollView.alloc().initWithFrame_(frame)
        scroll.setHasVerticalScroller_(True)
        scroll.setAutoresizingMask_(NSViewWidthSizable | NSViewHeightSizable)
        size = scroll.contentSize()
        text = NSTextView.alloc().initWithFrame_(NSMakeRect(0, 0, size.width, size.height))
        text.setMinSize_(NSMakeSize(0.0, size.height))
        text.setMaxSize_(NSMakeSize(1e7, 1e7))
        text.setVerticallyResizable_(True)
        text.setHorizontallyResizable_(False)
        text.setAutoresizingMask_(NSViewWidthSizable)
        text.textContainer().setContainerSize_(NSMakeSize(size.width, 1e7))
        text.textContainer().setWidthTracksTextView_(True)
        text.setEditable_(False)
        text.setSelectable_(True)
        text.setFont_(NSFont.systemFontOfSize_(13))
        scroll.setDocumentView_(text)
        self.panel.setContentView_(scroll)
        self.panel.center()
        self.text = text
        self._shown = ""

    def show(self) -> None:
        bring_to_front(self.panel)

    def set_text(self, text: str) -> None:
        if text != self._shown:  # redrawing an unchanged text view makes it flicker
            self._shown = text
            self.text.setString_(text)
            self.text.scrollToEndOfDocument_(None)

    def set_title(self, title: str) -> None:
        self.panel.setTitle_(title)


def bring_to_front(window) -> None:  # type: ignore[no-untyped-def]
    """Make `window` the key window of the active app: an accessory app is not active when its
    menu is used, so a window it opens would stay behind others and get no keystrokes."""
    NSApplication.sharedApplication().activateIgnoringOtherApps_(True)
    window.makeKeyAndOrderFront_(None)


def stop_event_loop() -> None:
    """End `rumps.App.run` (PyObjC's `AppHelper.runEventLoop`) so that `main` returns and Python
    exits normally: `rumps.quit_application` terminates through NSApplication, which calls C
    `exit()` with the model's threads alive and never runs Python's atexit hooks."""
    from PyObjCTools import AppHelper

    AppHelper.stopEventLoop()


class MenuBarApp(rumps.App):
    def __init__(self, ctrl: ChatController, model: str | None = None) -> None:
        super().__init__("ondevice", title=TITLES[ChatState.IDLE], quit_button=None)
        self.ctrl = ctrl
        self.panel: AnswerPanel | None = None
        self.ask_item = rumps.MenuItem("Ask…", callback=self.ask, key="n")
        self.show_item = rumps.MenuItem("Show Answer", callback=self.show_answer)
        self.stop_item = rumps.MenuItem("Stop", callback=None, key=".")
        self.copy_item = rumps.MenuItem("Copy Answer", callback=self.copy_answer, key="c")
        self.models_item = rumps.MenuItem("Model")
        self.speed_item = rumps.MenuItem("No answer yet")
        self.status_item = rumps.MenuItem("")  # what a long step is doing
        self.limits_item = rumps.MenuItem(format_limits(None))
        self.error_item = rumps.MenuItem("")
        self.menu = [
            self.ask_item,
            self.show_item,
            self.stop_item,
            self.copy_item,
            None,
            self.models_item,
            rumps.MenuItem("System Prompt…", callback=self.edit_system_prompt),
            rumps.MenuItem("New Chat", callback=self.new_chat),
            None,
            self.status_item,
            self.speed_item,
            self.limits_item,
            self.error_item,
            None,
            rumps.MenuItem("Quit", callback=self.quit, key="q"),
        ]
        self._set_hidden(self.error_item, True)
        self._set_hidden(self.status_item, True)
        self._state: ChatState | None = None
        self.refresh_models()
        self.timer = rumps.Timer(self.poll, POLL_SECONDS)
        self.timer.start()
        # also while a menu is open (event tracking mode), not only in the default mode
        NSRunLoop.currentRunLoop().addTimer_forMode_(self.timer._nstimer, NSRunLoopCommonModes)
        start = self.initial_model(model)
        if start is not None:
            self.load(start)

    # -- models ----------------------------------------------------------------------------------

    def initial_model(self, requested: str | None) -> str | None:
        """The model given on the command line, else the one last used, else the first bundle."""
        if requested:
            return requested
        bundles = installed_bundles()
        saved = self.ctrl.saved_model
        for b in bundles:
            if b.name == saved:
                return str(b.path)
        return str(bundles[0].path) if bundles else None

    def refresh_models(self, _sender=None) -> None:  # type: ignore[no-untyped-def]
        if self.models_item._menu is not None:  # rumps builds the submenu lazily
            self.models_item.clear()
        bundles = installed_bundles()
        if not bundles:
            self.models_item.add(rumps.MenuItem("No bundles installed (see `ondevice pull`)"))
        for b in bundles:
            item = rumps.MenuItem(f"{b.name}  ({human_size(b.size_bytes)})", callback=None)
            item.set_callback(self._loader_for(b))
            item.state = int(b.name == self.ctrl.model_name)
            self.models_item.add(item)
        self.models_item.add(None)
        self.models_item.add(rumps.MenuItem("Refresh List", callback=self.refresh_models))

    def _loader_for(self, bundle: InstalledModel):  # type: ignore[no-untyped-def]
        def load(_sender) -> None:  # type: ignore[no-untyped-def]
            self.load(bundle.path)

        return load

    def load(self, model: str | Path) -> None:
        """Say what is coming before the load starts: once it compiles, the screen is frozen."""
        self.status_item.title = LOADING_TEXT.format(name=Path(model).name)
        self._set_hidden(self.status_item, False)
        self.title = TITLES[ChatState.LOADING]
        self.ctrl.load(model)

    # -- actions -----------------------------------------------------------------------------------

    def ask(self, _sender) -> None:  # type: ignore[no-untyped-def]
        if self.ctrl.busy:
            rumps.alert("ondevice", "Wait for the current answer, or stop it first.")
            return
        window = rumps.Window(
            message="Ask the model:",
            title="ondevice",
            default_text="",
            ok="Send",
            cancel="Cancel",
            dimensions=(420, 120),
        )
        response = self._run_window(window)
        if response.clicked and response.text.strip():
            if self.ctrl.send(response.text):
                self.show_answer(None)

    def show_answer(self, _sender) -> None:  # type: ignore[no-untyped-def]
        if self.panel is None:
            self.panel = AnswerPanel()
        self.update_panel()
        self.panel.show()

    def stop(self, _sender) -> None:  # type: ignore[no-untyped-def]
        self.ctrl.stop()

    def copy_answer(self, _sender) -> None:  # type: ignore[no-untyped-def]
        board = NSPasteboard.generalPasteboard()
        board.clearContents()
        board.setString_forType_(self.ctrl.answer, NSPasteboardTypeString)  # raw text

    def edit_system_prompt(self, _sender) -> None:  # type: ignore[no-untyped-def]
        window = rumps.Window(
            message="System prompt (applies to the next answers):",
            title="ondevice",
            default_text=self.ctrl.system_prompt,
            ok="Save",
            cancel="Cancel",
            dimensions=(420, 120),
        )
        response = self._run_window(window)
        if response.clicked:
            self.ctrl.set_system_prompt(response.text)

    def new_chat(self, _sender) -> None:  # type: ignore[no-untyped-def]
        self.ctrl.reset()
        self.update_panel()

    @staticmethod
    def _run_window(window: rumps.Window):  # type: ignore[no-untyped-def]
        bring_to_front(window._alert.window())
        return window.run()

    def quit(self, _sender) -> None:  # type: ignore[no-untyped-def]
        self.title = "…"
        self.timer.stop()
        self.ctrl.close()  # stops the answer (saved with the history) and the model's threads
        stop_event_loop()

    # -- main-thread updates ---------------------------------------------------------------------

    def poll(self, _timer) -> None:  # type: ignore[no-untyped-def]
        """Runs on the main thread: apply what the worker reported since the last tick."""
        events = self.ctrl.drain()
        for event in events:
            if event.kind == "error":
                self.error_item.title = f"⚠ {event.text[:80]}"
                self._set_hidden(self.error_item, False)
            elif event.kind == "loaded":
                self.refresh_models()
                self._set_hidden(self.error_item, True)
            elif event.kind == "state" and event.state is ChatState.IDLE:
                self._set_hidden(self.status_item, True)
            elif event.kind == "state" and event.state is ChatState.GENERATING:
                self._set_hidden(self.error_item, True)
        state = self.ctrl.state
        title = ("⚠ " if self.ctrl.error else "") + TITLES[state]
        if title != self.title:
            self.title = title
        if state is not self._state:  # Stop is clickable only while an answer streams
            self._state = state
            self.stop_item.set_callback(self.stop if state is ChatState.GENERATING else None)
        live = self.ctrl.live_stats()
        self.speed_item.title = format_stats(live if live is not None else self.ctrl.last_stats)
        self.limits_item.title = format_limits(self.ctrl.limits())
        if events or live is not None:
            self.update_panel()

    def update_panel(self) -> None:
        if self.panel is None:
            return
        ctrl = self.ctrl
        question = next((m["content"] for m in reversed(ctrl.messages) if m["role"] == "user"), "")
        parts = [f"You: {question}", "", ctrl.answer] if question else [ctrl.answer]
        if ctrl.error:
            parts += ["", f"⚠ {ctrl.error}"]
        self.panel.set_text("\n".join(parts))
        model = ctrl.model_name or "no model"
        live = ctrl.live_stats()
        self.panel.set_title(f"{model} — {format_stats(live or ctrl.last_stats)}")

    @staticmethod
    def _set_hidden(item: rumps.MenuItem, hidden: bool) -> None:
        item._menuitem.setHidden_(hidden)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ondevice-menubar", description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="bundle or model to load at start")
    args = parser.parse_args(argv)
    # an accessory app: no Dock icon, yet it may activate and own key windows (an unbundled
    # Python otherwise starts with a policy that lets its windows open behind others)
    NSApplication.sharedApplication().setActivationPolicy_(NSApplicationActivationPolicyAccessory)
    ctrl = ChatController(history_path=history_path())
    app = MenuBarApp(ctrl, model=args.model)
    app.run()  # returns after Quit (stop_event_loop)
    ctrl.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
