# check: stopped at the wall-time limit
import subprocess
import sys


def build(device):
    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    subprocess.run([sys.executable, '-c', 'import time; time.sleep(600)'])
    return {}
