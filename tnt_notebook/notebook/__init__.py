"""Runs in the notebook kernel the user types into: the magics, running cells on the ranks, the
progress views and the kernelspec. Never imports TensorFlow and never joins the MPI world."""
