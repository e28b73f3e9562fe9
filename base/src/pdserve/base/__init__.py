"""What the operator and the workers share: option parsing, ports, processes, the pool's
credential file and the installed parts' versions. Standard library only; imports
nothing else of pdserve."""
