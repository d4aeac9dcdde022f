"""Tool calling: tools rendered into the prompt (`prompt.py`), the model's calls parsed from
its text in its own format (`parsers.py`, a registry), and tool_choice "required" or a named
function enforced with a grammar in that same format (`grammar.py`)."""
