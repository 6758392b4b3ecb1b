"""Parallelism: how ranks share the work, and every byte that moves.

``comm`` holds the only MPI calls (with host staging, the counters of
``comm_counters`` and the 16-bit wire of ``comm_wire``; ``comm_agree`` the
uncounted agreement on host objects such as rank 0's verdict; ``comm_start`` the nonblocking all-reduce
and broadcast that layouts overlap with GEMMs; ``comm_p2p`` the
point-to-point sends, receives and ring shifts of pipeline stages and
context parallelism), each completed by ``waiting``'s wait, which polls
and then sleeps, and noted there for the ``watchdog`` thread of
``--collective-timeout``; ``gridspec`` is the run's plan as one value
(every axis and mode), ``planning`` validates it once, purely, and ``grid``
builds one communicator per axis (dp, pp, cp, tp) from the world; ``context`` is context parallelism's chunks and ring attention; ``layouts`` holds serial, 1-D, 2-D, 2.5-D
and 3-D tensor parallelism behind one protocol; ``params`` is each rank's
flat parameter and gradient buffer (``paramspec`` what a parameter is and
which block of it a rank holds); ``gradients`` sums gradients over
replica groups and dp and takes the norm; ``zero`` partitions the buffer
over dp for --zero 1 (per layer for 2 and 3); ``fsdp`` is the store of
--zero 2 and 3, which reduce-scatters each layer's gradients and gathers
its weights as the model walks its blocks (``fsdp_stream`` that walk);
``profiler`` records the spans of ``--profile`` (``comm`` hands it every
call, ``comm_counters`` every wait); ``schedules``
holds the pipeline schedules as pure data (GPipe, 1F1B, interleaved; the
zero-bubble ZB-H1, ZBV and DualPipeV of ``schedules_zb`` and
``schedules_dualpipe``), the layer split and the validation of the
pipeline options, with a simulator that checks them without MPI;
``wgrad`` is the seam between a backward's input and weight phases, which
every layout's linear hands its dW to.

May import: ``core``, ``device``, ``ops``.
"""
