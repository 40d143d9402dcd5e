"""The rank's checks for silent mistakes (``ddpmon/advice/__init__.py`` lists the kinds):
``watch.Advice`` builds one check per module and records what they find; ``compare`` (in
the torch-free ``ddpmon.advice``) compares this rank's fingerprints with its peers'."""
