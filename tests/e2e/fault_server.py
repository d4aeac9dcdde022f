"""`python -m tests.e2e.fault_server serve ...`: kvserve serve with one injected fault, for the
tests of what the server does when its engine thread dies. The real server, except that an
engine step raises once a running request's prompt text contains FAULT_TRIGGER."""

from __future__ import annotations

import sys
from typing import Any

from kvserve.cli import main
from kvserve.llm_engine import LLMEngine

FAULT_TRIGGER = "__kvserve_injected_fault__"


def _faulty_step(self: LLMEngine) -> Any:
    if any(FAULT_TRIGGER in (r.prompt or "") for r in self.scheduler.running):
        raise RuntimeError("injected fault: the device is gone")
    return _real_step(self)


_real_step = LLMEngine.step
LLMEngine.step = _faulty_step  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
