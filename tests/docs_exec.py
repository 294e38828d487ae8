"""Runs a doc's ```python blocks one by one in one namespace (driven by tests/docs_snippets.py).

Reads one JSON request per line on stdin ({doc, line, code, given, given_line, env}); answers each
with one line that starts with the result tag. Tracebacks name the doc and its line numbers.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

RESULT_TAG = "@@docs-result@@ "


def main() -> None:
    sys.path.insert(0, os.getcwd())  # like `python -c`: the working directory is importable
    answer = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the blocks' prints go to stderr (the test shows them)
    sys.stdout = sys.stderr
    namespace: dict = {"__name__": "__main__"}
    for request_line in sys.stdin:
        request = json.loads(request_line)
        os.environ.update(request["env"])
        try:
            if request["given"]:
                # padded with newlines so that tracebacks show the doc's own line numbers
                source = "\n" * (request["given_line"] - 1) + request["given"]
                exec(compile(source, f"{request['doc']} (docs: given)", "exec"), namespace)
            exec(compile("\n" * request["line"] + request["code"], request["doc"], "exec"), namespace)
            result = {"ok": True}
        except BaseException:  # noqa: BLE001 - everything a block raises is reported, SystemExit included
            result = {"ok": False, "error": traceback.format_exc()}
        sys.stderr.flush()
        answer.write("\n" + RESULT_TAG + json.dumps(result) + "\n")
        answer.flush()


if __name__ == "__main__":
    main()
