#!/bin/bash
# Millwright demo job: fetch a firmware image from the line's update server.
#   $1 side-effect directory  $2 server address  $3 server port  $4 image name
# In the demo the server's port is blackholed after the TCP handshake (an nftables table
# of the demo's own drops every segment that carries data), so the request is
# retransmitted and never answered: a real network stall, visible to the BPF sensor.
uid=
while read -r key value _; do [ "$key" = "Uid:" ] && uid=$value; done < /proc/$$/status
echo "$MILLWRIGHT_JOB_ID $MILLWRIGHT_FIRE_ID $MILLWRIGHT_ATTEMPT $$ $uid" >> "$1/effects.log"
exec 3<>"/dev/tcp/$2/$3" || { echo "cannot connect to $2:$3"; exit 2; }
echo "connected to $2:$3, requesting $4"
printf 'GET /firmware/%s.bin HTTP/1.0\r\nX-Padding: %4000s\r\n\r\n' "$4" x >&3
if read -r -t 120 reply <&3; then echo "server answered: $reply"; exit 0; fi
echo "no answer from $2:$3"
exit 3
