"""A harness for the tests and the benchmarks, outside the product's runtime path: ``ranks``
runs a script or module on local ranks under torchrun and collects what each rank reports;
``comm_audit`` records the collectives of a training step and the least its layout must move.

Nothing in neuron_parallel's runtime modules, ``tasks/`` or ``flows/`` imports this package
(``tests/unit/test_testing_package.py`` checks it).
"""
