"""One process accepts N links on one port (MPI_Comm_accept on COMM_SELF), as a replacement does
(runtime/replacement.py); it writes ``accepted`` when all N have linked."""

import faulthandler
import os
import sys

from mpi4py import MPI

faulthandler.enable()
port = MPI.Open_port()
with open("port.tmp", "w") as f:
    f.write(port)
os.rename("port.tmp", "port")
for _ in range(int(sys.argv[1])):
    link = MPI.COMM_SELF.Accept(port)
    link.recv(source=0, tag=5)
open("accepted", "w").close()
os._exit(0)
