#!/usr/bin/env python3
"""The tree's layering rules (docs/architecture.md), checked on every test run.

- No file under worker/ or client/ includes a header of server/: code that servers, workers and the
  CLI share lives at the top (common/, kernels/, rpc/).
- No source file directly in worker/trainer/ beyond the trainer itself (trainer.h, trainer.cc),
  main.cc and the precompiled header: everything else lives in a folder by concern.
Usage: check_layout.py REPO_ROOT
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)
TRAINER_TOP = {'trainer.h', 'trainer.cc', 'main.cc', 'pch.h'}


def main():
    root = sys.argv[1]
    bad = []
    checked = 0
    for top in ('worker', 'client'):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, top))):
            for name in sorted(names):
                if not name.endswith(('.h', '.cc')):
                    continue
                path = os.path.join(dirpath, name)
                checked += 1
                with open(path, encoding='utf-8') as f:
                    for included in INCLUDE.findall(f.read()):
                        if included.startswith('server/'):
                            bad.append(f'{os.path.relpath(path, root)}: includes "{included}"')
    trainer = os.path.join(root, 'worker', 'trainer')
    for name in sorted(os.listdir(trainer)):
        if os.path.isfile(os.path.join(trainer, name)) and name.endswith(('.h', '.cc')):
            if name not in TRAINER_TOP:
                bad.append(f'worker/trainer/{name}: belongs in a folder of worker/trainer/')
    for line in bad:
        print(line)
    print(f'{checked} files of worker/ and client/ checked, {len(bad)} break the layout')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
