#!/bin/sh
# Progress test job: appends a progress line to $MILLWRIGHT_PROGRESS every $3 s for $2 s
# (each also logged, with this job's own clock, to $1 as "line <job> <n> <epoch>"), then $4:
#   hang      report nothing more and sleep (a hung step)
#   result    write a result document to $MILLWRIGHT_RESULT and exit 0
#   big       write a 5,000-byte result (refused: at most 4 KiB) and exit 0
#   lastline  send the result as the last progress line's "result" and exit 0
#   junk      write lines that are not valid progress, then exit 0
log=$1 secs=$2 every=$3 then=$4
end=$(( $(date +%s) + secs ))
i=0
while [ "$(date +%s)" -lt "$end" ]; do
  i=$((i + 1))
  echo "{\"progress\": $i, \"step\": \"block $i\", \"detail\": {\"i\": $i}}" >> "$MILLWRIGHT_PROGRESS"
  echo "line $MILLWRIGHT_JOB_ID $i $(date +%s.%N)" >> "$log"
  sleep "$every"
done
case "$then" in
  hang) echo "hang $MILLWRIGHT_JOB_ID $(date +%s.%N)" >> "$log"; sleep 3600 ;;
  result) echo "{\"blocks\": $i, \"found\": \"bearing wear 0.2 mm\"}" > "$MILLWRIGHT_RESULT" ;;
  big) printf '{"x": "%05000d"}' 0 > "$MILLWRIGHT_RESULT" ;;
  lastline) echo "{\"progress\": 100, \"step\": \"done\", \"result\": {\"blocks\": $i}}" >> "$MILLWRIGHT_PROGRESS" ;;
  junk) { echo "not json"; echo '{"progress": 300}'; echo '{"what": 1}'; } >> "$MILLWRIGHT_PROGRESS" ;;
esac
echo "end $MILLWRIGHT_JOB_ID $(date +%s.%N)" >> "$log"
exit 0
