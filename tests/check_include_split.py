#!/usr/bin/env python3
"""No file of the trainer sees both LibTorch and gRPC/protobuf (worker/CMakeLists.txt says why).

For each C++ file under worker/trainer/ and its folders (and the trainer's tests), follows its project includes
("dir/file.h", resolved from the repository root) and fails if what it reaches includes both a
LibTorch header (<torch/...>, <ATen/...>, <c10/...>) and a gRPC or generated protobuf header
(<grpcpp/...>, "*.pb.h"). Usage: check_include_split.py REPO_ROOT
"""
import os
import re
import sys

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)
TORCH = re.compile(r'^(torch|ATen|c10)/')
GRPC = re.compile(r'^grpcpp/|\.pb\.h$')


def closure(root, path, seen):
    """System includes reached from `path` through project headers."""
    if path in seen:
        return set()
    seen.add(path)
    found = set()
    with open(os.path.join(root, path), encoding='utf-8') as f:
        text = f.read()
    for kind, name in INCLUDE.findall(text):
        local = os.path.join(root, name)
        if kind == '"' and not name.endswith('.pb.h') and os.path.isfile(local):
            found |= closure(root, name, seen)
        else:
            found.add(name)
    return found


def main():
    root = sys.argv[1]
    files = []
    for d in ('worker/trainer',):
        for dirpath, _, names in sorted(os.walk(os.path.join(root, d))):
            for name in sorted(names):
                if name.endswith(('.h', '.cc')):
                    files.append(os.path.relpath(os.path.join(dirpath, name), root))
    files.append('tests/trainer_unit_test.cc')
    bad = []
    for f in files:
        reached = closure(root, f, set())
        torch = sorted(n for n in reached if TORCH.match(n))
        grpc = sorted(n for n in reached if GRPC.search(n))
        if torch and grpc:
            bad.append(f'{f}: reaches LibTorch ({torch[0]}) and gRPC/protobuf ({grpc[0]})')
    for line in bad:
        print(line)
    print(f'{len(files)} files checked, {len(bad)} include both LibTorch and gRPC/protobuf')
    return 1 if bad else 0


if __name__ == '__main__':
    sys.exit(main())
