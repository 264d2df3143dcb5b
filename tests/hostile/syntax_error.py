# check: line 3: syntax error
# run: line 3: syntax error
def build(device)
    return {}
