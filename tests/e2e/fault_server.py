"""`python -m tests.e2e.fault_server serve ...`: kvserve serve with one injected fault, for the
tests of what the server does when its engine thread dies. The real server, except that an
engine step raises once a running request's prompt text contains FAULT_TRIGGER.

Importing this module (for FAULT_TRIGGER) changes nothing: the fault is injected only when it
runs as the server's main module."""

from __future__ import annotations

import sys
from typing import Any

FAULT_TRIGGER = "__kvserve_injected_fault__"


def _inject_fault() -> None:
    from kvserve.llm_engine import LLMEngine

    real_step = LLMEngine.step

    def faulty_step(self: LLMEngine) -> Any:
        if any(FAULT_TRIGGER in (r.prompt or "") for r in self.scheduler.running):
            raise RuntimeError("injected fault: the device is gone")
        return real_step(self)

    LLMEngine.step = faulty_step  # type: ignore[method-assign]


if __name__ == "__main__":
    from kvserve.cli import main

    _inject_fault()
    sys.exit(main(sys.argv[1:]))
