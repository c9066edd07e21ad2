"""appliance: Horovod/Keras training on Chameleon Cloud leases.

Data flows one way: spec -> lease -> cluster -> stage -> train -> checkpoint -> resume.
"""

__version__ = "0.1.0"
