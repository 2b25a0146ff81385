"""Builders and waits that several test modules share: import them as ``tests.helpers.<module>``.

- ``tiny``: run specs and packed training batches on the tiny model.

Test modules run as scripts in a child process (tests/policy/test_fsdp.py under torchrun) do not see the repository
root on ``sys.path`` and so cannot import these.
"""
