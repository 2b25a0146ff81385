"""Builders and waits that several test modules share: import them as ``tests.helpers.<module>``.

- ``keys``: real signing keys for made-up node ids (relay slot requests are signed).
- ``net``: a free loopback port.
- ``tiny``: run specs and packed training batches on the tiny model.
- ``wait``: poll a condition until it holds, with a deadline.

Test modules run as scripts in a child process (tests/policy/test_fsdp.py under torchrun) do not see the repository
root on ``sys.path`` and so cannot import these.
"""
