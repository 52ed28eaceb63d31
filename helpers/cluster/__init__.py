"""torchrun from a notebook cell: a script of scripts/ under one agent (`torchrun`), several agents as the nodes of a
multi-node job on this machine (`agents`, notebook 09). Unlike `helpers.launcher`, which starts ranks from the
kernel, these start torchrun's own agents, which start the ranks; what they share with it is how a process is
stopped with everything it started (`helpers.launcher.sessions`)."""
