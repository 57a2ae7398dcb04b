"""Worker scripts that tests start as processes (a plain ``python``, or ranks under torchrun):
each trains, saves or loads something under a parallel layout and writes what it saw to a file
for the test to check."""
