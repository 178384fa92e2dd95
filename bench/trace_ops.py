#!/usr/bin/env python3
"""Which operations launched a trace's kernels: for each kernel whose name contains PATTERN, the
innermost operations (cpu_op events on the launching thread around the launch) and the GPU time
they account for, per step.

Use it on a trainer trace taken eagerly (gpu_bench.sh --profile with TRAINYARD_PROFILE_FLAGS=
"--cuda-graphs off"): a replayed CUDA graph's kernels all trace to cudaGraphLaunch.

    python3 bench/trace_ops.py --steps 3 TRACE.json.gz PATTERN [PATTERN...]
"""
import argparse
import collections
import gzip
import json


def load(path):
    opener = gzip.open if path.endswith('.gz') else open
    with opener(path, 'rt') as f:
        trace = json.load(f)
    return trace['traceEvents'] if isinstance(trace, dict) else trace


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--steps', type=int, required=True, help='steps the trace holds')
    parser.add_argument('--depth', type=int, default=3, help='operations shown per stack')
    parser.add_argument('trace')
    parser.add_argument('patterns', nargs='+')
    args = parser.parse_args()
    launches, ops, kernels = {}, collections.defaultdict(list), []
    for e in load(args.trace):
        if e.get('ph') != 'X':
            continue
        cat = e.get('cat', '')
        if cat in ('cuda_runtime', 'cuda_driver'):
            launches[e.get('args', {}).get('correlation')] = e
        elif cat == 'cpu_op':
            ops[e['tid']].append(e)
        elif cat == 'kernel':
            kernels.append(e)
    for pattern in args.patterns:
        us, count = collections.Counter(), collections.Counter()
        for k in kernels:
            if pattern not in k['name']:
                continue
            launch = launches.get(k.get('args', {}).get('correlation'))
            stack = '?'
            if launch is not None:
                around = sorted((o for o in ops[launch['tid']]
                                 if o['ts'] <= launch['ts'] <= o['ts'] + o['dur']),
                                key=lambda o: o['ts'])
                stack = ' > '.join(o['name'] for o in around[-args.depth:]) or '(no operation)'
            us[stack] += k['dur']
            count[stack] += 1
        print(f'== {pattern}')
        for stack, total in us.most_common(12):
            print(f'{total / 1e3 / args.steps:8.3f} ms a step  {count[stack] / args.steps:6.1f} '
                  f'calls  {stack}')


if __name__ == '__main__':
    main()
