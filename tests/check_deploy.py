#!/usr/bin/env python3
"""Checks that the deploy files agree with the programs and with each other.

- Every flag of every invocation (the systemd units' ExecStart, the container's ENTRYPOINT and
  CMD, the Kubernetes containers' args) is one the program's --help lists; --metrics-tls comes
  with --tls-cert and --tls-key.
- Every port Prometheus scrapes (dashboards/prometheus/prometheus.yml, the pods' prometheus.io
  annotations) is the --metrics-address port of the program that job scrapes, with https where
  that program serves --metrics-tls and a bearer token where it wants --metrics-token-file.
- The container's runtime packages cover every library the control-plane programs link (ldd,
  then dpkg's file lists), but for those of the slim base image; the worker image's
  (deploy/container/Dockerfile.worker) cover what trainyard-worker links, and, given the CUDA
  build of trainyard-trainer and the folders of its LibTorch and CUDA libraries (which the image
  copies), what that trainer links from the system.

    python3 tests/check_deploy.py PROJECT_ROOT BIN_DIR [CUDA_TRAINER LIBRARY_PATH]
"""
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import yaml

# Prometheus job name -> the program it scrapes (and its systemd unit).
SCRAPED = {
    "trainyard-coordinator": "trainyard-coordinator",
    "trainyard-worker": "trainyard-worker",
    "trainyard-ps": "trainyard-ps",
}
# What the container must run (trainyard-trainer needs LibTorch, which the image leaves out).
CONTAINER_PROGRAMS = ["trainyard-coordinator", "trainyard-ps", "trainyard-worker", "yard"]
# In debian:12-slim already.
BASE_PACKAGES = {"libc6", "libgcc-s1", "libstdc++6"}

failures = []


def fail(where, message):
    failures.append(f"{where}: {message}")


def help_flags(bin_dir, program, cache={}):
    if program not in cache:
        out = subprocess.run([os.path.join(bin_dir, program), "--help"], capture_output=True,
                             text=True, check=False).stdout
        cache[program] = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out))
    return cache[program]


def flag_values(argv):
    """{--flag: value or None} of an argument list (--flag value, --flag=value, --switch)."""
    out = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                name, value = a.split("=", 1)
                out[name] = value
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a] = argv[i + 1]
                i += 1
            else:
                out[a] = None
        i += 1
    return out


def check_invocation(where, bin_dir, program, argv):
    flags = flag_values(argv)
    known = help_flags(bin_dir, program)
    for flag in flags:
        if flag not in known:
            fail(where, f"{program} has no flag {flag} (see {program} --help)")
    if "--metrics-tls" in flags and not ("--tls-cert" in flags and "--tls-key" in flags):
        fail(where, "--metrics-tls needs --tls-cert and --tls-key")
    return flags


def port_of(address):
    return address.rsplit(":", 1)[1] if address and ":" in address else None


def systemd_units(root, bin_dir):
    """{program: flags} of deploy/systemd/*.service."""
    units = {}
    folder = os.path.join(root, "deploy/systemd")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".service"):
            continue
        text = open(os.path.join(folder, name)).read()
        # ExecStart with its continuation lines (comments inside a continued line end it).
        joined = re.sub(r"\\\n", " ", text)
        match = re.search(r"^ExecStart=(.*)$", joined, re.M)
        if not match:
            fail(name, "no ExecStart")
            continue
        argv = shlex.split(match.group(1))
        program = os.path.basename(argv[0])
        units[program] = check_invocation(name, bin_dir, program, argv[1:])
    return units


def container(root, bin_dir, name="Dockerfile"):
    """The Dockerfile's runtime packages, and its default invocation checked."""
    path = os.path.join(root, "deploy/container", name)
    text = open(path).read()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*?\])$", text, re.M | re.S).group(1))
    cmd_match = re.search(r"^CMD (\[.*?\])$", text.replace("\\\n", ""), re.M | re.S)
    cmd = json.loads(cmd_match.group(1)) if cmd_match else []
    program = os.path.basename(entry[0])
    check_invocation(name, bin_dir, program, entry[1:] + cmd)
    runtime = text[text.rindex("FROM "):]
    install = re.search(r"apt-get install -y --no-install-recommends(.*?)&&", runtime.replace(
        "\\\n", " "), re.S)
    packages = set(install.group(1).split()) if install else set()
    return program, packages


def kubernetes(root, bin_dir, image_program):
    """{program: (flags, annotations)} of the containers of deploy/kubernetes/*.yaml."""
    found = {}
    folder = os.path.join(root, "deploy/kubernetes")
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".yaml"):
            continue
        for doc in yaml.safe_load_all(open(os.path.join(folder, name))):
            template = ((doc or {}).get("spec") or {}).get("template")
            if not template:
                continue
            annotations = (template.get("metadata") or {}).get("annotations") or {}
            for c in template["spec"]["containers"]:
                command = c.get("command")
                program = os.path.basename(command[0]) if command else image_program
                flags = check_invocation(f"{name} ({c['name']})", bin_dir, program,
                                         (command or [])[1:] + c.get("args", []))
                found[program] = (flags, annotations, name)
    return found


def check_scrapes(root, units, pods):
    config = yaml.safe_load(open(os.path.join(root, "dashboards/prometheus/prometheus.yml")))
    for job in config["scrape_configs"]:
        program = SCRAPED.get(job["job_name"])
        if program is None:
            continue
        flags = units.get(program)
        where = f"prometheus.yml job {job['job_name']}"
        if flags is None:
            fail(where, f"no systemd unit runs {program}")
            continue
        port = port_of(flags.get("--metrics-address"))
        if port is None:
            fail(where, f"the {program} unit sets no --metrics-address")
            continue
        for sc in job.get("static_configs", []):
            for target in sc.get("targets", []):
                if port_of(target) != port:
                    fail(where, f"scrapes {target}, but the {program} unit serves metrics on "
                                f":{port}")
        tls = "--metrics-tls" in flags
        if tls != (job.get("scheme") == "https"):
            fail(where, f"scheme {job.get('scheme', 'http')}, but the unit "
                        f"{'serves' if tls else 'does not serve'} --metrics-tls")
        if ("--metrics-token-file" in flags) != ("authorization" in job):
            fail(where, "a bearer token exactly when the unit sets --metrics-token-file")
    for program, (flags, annotations, name) in pods.items():
        if annotations.get("prometheus.io/scrape") != "true":
            continue
        port = port_of(flags.get("--metrics-address"))
        if annotations.get("prometheus.io/port") != port:
            fail(name, f"prometheus.io/port {annotations.get('prometheus.io/port')}, but "
                       f"{program} serves metrics on :{port}")
        if ("--metrics-tls" in flags) != (annotations.get("prometheus.io/scheme") == "https"):
            fail(name, "prometheus.io/scheme https exactly when --metrics-tls")


def dpkg_owners(cache={}):
    """Every file an installed package ships -> the package (dpkg's lists, read once: `dpkg -S`
    reads them all on every call, a second or so each)."""
    if not cache:
        for list_file in glob.glob("/var/lib/dpkg/info/*.list"):
            package = os.path.basename(list_file)[:-len(".list")].split(":", 1)[0]
            with open(list_file, errors="replace") as f:
                for line in f:
                    cache.setdefault(line.rstrip("\n"), package)
    return cache


def package_of(path):
    owners = dpkg_owners()
    for candidate in (path, os.path.realpath(path), "/usr" + path,
                      path[4:] if path.startswith("/usr/") else None):
        if candidate and candidate in owners:
            return owners[candidate]
    return None


def dpkg_depends(cache={}):
    """Installed package -> its Depends and Pre-Depends clauses (one dpkg-query for all)."""
    if not cache:
        out = subprocess.run(["dpkg-query", "-W", "-f=${Package}\t${Depends}, ${Pre-Depends}\n"],
                             capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            package, _, depends = line.partition("\t")
            cache[package] = cache.get(package, "") + ", " + depends
    return cache


def with_dependencies(packages):
    """`packages` and what apt installs with them: the closure of their Depends and Pre-Depends
    (every alternative counted; the names as dpkg knows them on this machine)."""
    depends = dpkg_depends()
    seen, todo = set(), list(packages)
    while todo:
        package = todo.pop()
        if package in seen:
            continue
        seen.add(package)
        for clause in depends.get(package, "").split(","):
            for alternative in clause.split("|"):
                name = alternative.strip().split(" ")[0].split(":")[0]
                if name:
                    todo.append(name)
    return seen


def check_packages(bin_dir, packages, programs=CONTAINER_PROGRAMS, image="Dockerfile",
                   library_path=None):
    """Every library `programs` link (paths in BIN_DIR, or absolute) is in a package of the image,
    but those under `library_path`'s folders, which the image copies itself."""
    needed = {}
    copied = [d for d in (library_path or "").split(":") if d]
    env = dict(os.environ, LD_LIBRARY_PATH=library_path) if library_path else None
    for program in programs:
        path = program if os.path.isabs(program) else os.path.join(bin_dir, program)
        out = subprocess.run(["ldd", path], capture_output=True, text=True, check=True,
                             env=env).stdout
        for line in out.splitlines():
            if "not found" in line:
                fail(image, f"{os.path.basename(program)} links {line.split()[0]}, not found")
                continue
            match = re.search(r"=> (/\S+)", line)
            if not match or any(match.group(1).startswith(d.rstrip("/") + "/") for d in copied):
                continue
            package = package_of(match.group(1))
            if package is None:
                fail(image, f"{program} links {match.group(1)}, which no package owns")
                continue
            needed.setdefault(package, set()).add(os.path.basename(program))
    for package in sorted(set(needed) - BASE_PACKAGES - with_dependencies(packages)):
        fail(image, f"the runtime image lacks {package} (linked by "
                    f"{', '.join(sorted(needed[package]))})")
    return needed


def main():
    root, bin_dir = sys.argv[1], sys.argv[2]
    units = systemd_units(root, bin_dir)
    image_program, packages = container(root, bin_dir)
    pods = kubernetes(root, bin_dir, image_program)
    check_scrapes(root, units, pods)
    needed = check_packages(bin_dir, packages)
    worker_program, worker_packages = container(root, bin_dir, "Dockerfile.worker")
    if worker_program != "trainyard-worker":
        fail("Dockerfile.worker", f"runs {worker_program}, not trainyard-worker")
    check_packages(bin_dir, worker_packages, ["trainyard-worker"], "Dockerfile.worker")
    if len(sys.argv) > 4:  # the CUDA trainer the worker image ships
        check_packages(bin_dir, worker_packages, [os.path.abspath(sys.argv[3])],
                       "Dockerfile.worker", sys.argv[4])
    for f in failures:
        print("FAIL", f)
    if failures:
        return 1
    print(f"deploy files agree: {len(units)} units, {len(pods)} pod templates, the container's "
          f"{len(packages)} packages cover the {len(needed)} that "
          f"{', '.join(CONTAINER_PROGRAMS)} link, the worker image's cover trainyard-worker"
          + (" and the CUDA trainer" if len(sys.argv) > 4 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
