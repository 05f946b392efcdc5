#!/usr/bin/env python3
"""The include layers (docs/design.md, "Layout"), checked.

Each source folder may include its own private headers and the public
headers (include/ductile/) of its own layer and the layers below it:

    common      clock.h log.h
    control     + control.h (the agent-worker protocol)
    rendezvous  + etcd.h rdzv.h failpoint.h
    agent       + (nothing of the trainer's)
    trainer     + comm.h ddp.h elastic.h model.h layers.h optim.h data.h ckpt.h

A public header includes only headers of its own layer or below. No source
reaches into another folder ("../", or a private header that is not its
folder's). Prints every include that crosses a layer the wrong way and
exits 1; "layers: N files checked" and 0 when there is none.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYER_OF = {  # public header -> its layer
    "clock.h": "common", "log.h": "common", "control.h": "control",
    "etcd.h": "rendezvous", "rdzv.h": "rendezvous", "failpoint.h": "rendezvous",
    "comm.h": "trainer", "ddp.h": "trainer", "elastic.h": "trainer", "model.h": "trainer",
    "layers.h": "trainer", "optim.h": "trainer", "data.h": "trainer", "ckpt.h": "trainer",
}
BELOW = {  # what each layer may use, itself included
    "common": {"common"},
    "control": {"common", "control"},
    "rendezvous": {"common", "control", "rendezvous"},
    "agent": {"common", "control", "rendezvous", "agent"},
    "trainer": {"common", "control", "rendezvous", "trainer"},
}
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def check_file(path, layer, own_dir, bad):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for name in INCLUDE.findall(text):
        where = "%s: #include \"%s\"" % (os.path.relpath(path, ROOT), name)
        if name.startswith("ductile/"):
            header = name[len("ductile/"):]
            if header not in LAYER_OF:
                bad.append("%s: no such public header (add it to tests/layers.py)" % where)
            elif LAYER_OF[header] not in BELOW[layer]:
                bad.append("%s: the %s layer may not use the %s layer's header" %
                           (where, layer, LAYER_OF[header]))
        elif "/" in name or not os.path.exists(os.path.join(own_dir, name)):
            bad.append("%s: not a header of this folder (reach other components through "
                       "include/ductile/)" % where)


def main():
    bad, n = [], 0
    for folder in ("common", "control", "rendezvous", "agent", "trainer"):
        d = os.path.join(ROOT, folder)
        for f in sorted(os.listdir(d)):
            if f.endswith((".c", ".h", ".cu")):
                check_file(os.path.join(d, f), folder, d, bad)
                n += 1
    pub = os.path.join(ROOT, "include", "ductile")
    for f in sorted(os.listdir(pub)):
        if f.endswith(".h"):
            layer = LAYER_OF.get(f)
            if layer is None:
                bad.append("include/ductile/%s: in no layer (add it to tests/layers.py)" % f)
                continue
            check_file(os.path.join(pub, f), layer, pub, bad)
            n += 1
    for line in bad:
        print(line)
    print("layers: %d files checked, %d include%s crossing a layer the wrong way" %
          (n, len(bad), "" if len(bad) == 1 else "s"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
