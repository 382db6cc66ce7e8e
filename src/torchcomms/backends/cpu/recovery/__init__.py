"""Recovery for the CPU backend (ULFM's verbs and upstream's reconfigure).

* ``reconfigure``: init handles, who is who, and where the members meet;
* ``agree``: the survivors' agreement on who failed, through a store that outlives them.

May import the core modules and ``transport``; never the shm, tcp or window packages.
"""
