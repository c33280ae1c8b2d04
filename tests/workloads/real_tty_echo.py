"""real_tty_echo.py

An interactive line program for terminal tests (run in a tmux pane): turns
the terminal's ECHO off, prints `READY pid=N`, then answers each line it
reads from the terminal with

    ECHO: <line> #<count> sum=<running sum of line lengths> echo=<on|off> fg=<yes|no>

where echo tells whether the terminal's ECHO flag is set now (tcgetattr)
and fg whether its process group is the terminal's foreground group.
The line `quit` prints `BYE <count>` and exits 3; end of input exits 4.
"""

import os
import sys
import termios


def main():
    fd = sys.stdin.fileno()
    attrs = termios.tcgetattr(fd)
    attrs[3] &= ~termios.ECHO
    termios.tcsetattr(fd, termios.TCSANOW, attrs)
    count = 0
    total = 0
    print("READY pid=%d" % os.getpid(), flush=True)
    while True:
        line = sys.stdin.readline()
        if not line:
            print("EOF", flush=True)
            sys.exit(4)
        line = line.rstrip("\n")
        count += 1
        total += len(line)
        echo = "on" if termios.tcgetattr(fd)[3] & termios.ECHO else "off"
        fg = "yes" if os.tcgetpgrp(fd) == os.getpgrp() else "no"
        print("ECHO: %s #%d sum=%d echo=%s fg=%s" % (line, count, total, echo, fg), flush=True)
        if line == "quit":
            print("BYE %d" % count, flush=True)
            sys.exit(3)


if __name__ == "__main__":
    main()
