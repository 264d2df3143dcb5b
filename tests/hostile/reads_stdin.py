# check: EOFError
def build(device):
    answer = input('learning rate? ')
    return {}
