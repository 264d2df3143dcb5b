# check: stopped at the wall-time limit
def build(device):
    while True:
        pass
