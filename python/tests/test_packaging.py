"""`pip install ./python` alone, in a fresh venv from PyPI, gives a package that imports
trainyard.v1: the stubs are generated from proto/ when the package is built (setup.py). Runs on a
copy of python/ and proto/ without the stubs the development set-up generated."""
import pathlib
import shutil
import subprocess

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_pip_install_of_the_folder_alone_gives_a_working_package(tmp_path):
    copy = tmp_path / "repo"
    shutil.copytree(REPO / "proto", copy / "proto")
    shutil.copytree(REPO / "python", copy / "python", ignore=shutil.ignore_patterns(
        "v1", "*.egg-info", "build", "__pycache__", "tests"))
    assert not (copy / "python" / "trainyard" / "v1").exists()
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                              "--disable-pip-version-check", str(copy / "python")],
                             capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import trainyard, trainyard.v1.job_pb2 as j, trainyard.v1.job_pb2_grpc as g; "
         "print(j.SignalJobRequest(signal='USR1').signal, hasattr(g, 'JobServiceStub'), "
         "callable(trainyard.save_checkpoint))"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stderr
    assert check.stdout.split() == ["USR1", "True", "True"]
