# check: build(device) returned list; it must return a dict
def build(device):
    return [1, 2, 3]
