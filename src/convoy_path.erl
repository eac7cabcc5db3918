%% @private
%% The sender's decisions, pure: which path a remote message takes, decided from
%% facts the sender gathers (`unadmitted/3' before an admission, `decide/4' after
%% it, `overload/2' at the node's bound), the adaptive policy's arithmetic, and
%% the sender's own part of it (`own()': the calm it reuses, its last send to each
%% node). `convoy_send' reads the facts (its lane's counters, the node's route),
%% `convoy_sender' keeps the sender's state, and `convoy_send' carries the
%% decision out. Why each path keeps order is in `convoy_send''s header; in
%% short:
%% <ul>
%% <li>`direct' (a plain send to the destination) needs nothing of the sender's
%%   own to be waiting: no marker (nothing in an inbox), or, after an admission,
%%   the lane idle (nothing in the lane);</li>
%% <li>`inbox' (a batch of one to the inbox the sender's lane uses) needs the lane
%%   idle: it travels behind everything the lane shipped, through the same inbox;</li>
%% <li>`inbox_barrier' sends the message to that inbox as `inbox' does, with a
%%   barrier behind it: the inbox confirms it delivered everything up to it, and
%%   the sender drops its marker (it waits for that, not the message);</li>
%% <li>`barrier_direct' asks that inbox to confirm it delivered everything before
%%   (one round trip), then sends directly and drops the marker; the lane takes
%%   the message if the confirmation does not come in time;</li>
%% <li>`lane' is always safe.</li>
%% </ul>
%% A small message bypasses the lane only when the lane is calm (no small message
%% took it in the last `bypass_after' microseconds): a flood is batched rather than
%% leaking out one message at a time. A marked sender whose lane has been calm for
%% `SETTLED_US' sends through the inbox with a barrier behind and is back on
%% direct sends: after a burst, an idle request/response costs what plain `!'
%% costs. Below that, it goes through the inbox with no barrier, as senders in a
%% steady exchange would wait for one again and again. Only a large message waits
%% for its barrier before it leaves (it must not be copied into a batch).
%%
%% Batching is adaptive: for a sender that does not stream, a busy lane is
%% bypassed as a calm one is unless enough senders take turns on it and its
%% recent batches pay (`pays/3'); a marked sender then sends through the inbox
%% with a barrier behind to go direct again, so a few concurrent request/response
%% pairs travel as plain `!' would. While batches pay, a quiet lane is kept too
%% (`quiet/2'): under batching a closed loop's messages come in bursts.
-module(convoy_path).

-export([calm/2, streams/2, unpaid_until/2, pays/3, quiet/2, unadmitted/3, may_bypass/2, bypass/3,
         multicast/4, pieces/3, decide/4, overload/2, held_bytes/4, constants/0]).
%% The sender's own part: one state per sending process.
-export([own/0, reuse/1, unmarked_record/3, found/2, marked_record/5, skip/1, held_record/2,
         counted/2, entry_record/3, own_last/2, long_ago/1]).

-export_type([size/0, calm/0, route/0, own/0, skipped/0]).

%% The constants (SETTLED_US, PAYS_X16, PROBE_US, BATCH_SENDERS, ...) and why.
-include("convoy_policy.hrl").

%% "Long ago" for a last small send (a lane's or a sender's): any first send is
%% quiet, and no sender's first send streams.
-define(LONG_AGO_US, (1 bsl 40)).

-define(ENOUGH_SENDERS(Gaps), (element(2, Gaps) >= ?BATCH_SENDERS * element(1, Gaps))).

-type size() :: small | large.
%% busy: a small message took the lane within bypass_after (or batching is forced,
%% or, on a quiet lane, batches pay: `quiet/2');
%% unpaid: so did one, but batching does not pay there (`pays/3');
%% quiet: not within bypass_after; settled: not within SETTLED_US either.
-type calm() :: busy | unpaid | quiet | settled.
%% unanswered: a convoy peer that has not answered a sender's wait (a barrier, a
%% drain, a piece) since one ran out: its senders go through their lanes, so a
%% stall costs each of them at most that one wait (`convoy_metrics:unanswered/2').
-type route() :: convoy | unanswered | plain | none.

%% A sending process's own part of the policy (`convoy_sender' keeps it in the
%% sender's state): a calm it found and may take as found for `left' more small
%% sends (`CALM_REUSE'), and its last recorded small send to each node (the lanes'
%% clock). The small sends a marked sender made without recording them since its
%% last record (`SKIP_MAX') are a count beside it in that state (`skipped()'),
%% except while its node has messages held, a flood's every send: then the lane's
%% admissions count them (`held_record/2', `counted/2') and the send writes
%% nothing.
%% Streaming is judged per node, as a lane batches per node: a sender that sends
%% one message to each of several nodes in a row (a broadcast) streams to none of
%% them. A record's gap is divided by all the sends it stands for, to any node
%% (the reuse and skip counts are the sender's): one taking turns among nodes
%% looks at most that many times busier to each, which only keeps it in a lane
%% sooner.
-record(own, {calm = none :: none | calm(),
              left = 0 :: non_neg_integer(),
              last = #{} :: #{node() => integer()}}).
-opaque own() :: #own{}.
%% A marked sender's skipped records: counted while it streams, `undefined' while
%% it does not, `{since, V}' after a record held behind its node's messages that
%% took the lane's admission `V' (`counted/2').
-type skipped() :: non_neg_integer() | undefined | {since, integer()}.

%% @doc The policy's constants by name (convoy_policy.hrl), as doc/design.md's
%% table lists them.
-spec constants() -> #{atom() => integer()}.
constants() ->
    #{'SETTLED_US' => ?SETTLED_US, 'PAYS_X16' => ?PAYS_X16, 'PROBE_US' => ?PROBE_US,
      'BATCH_SENDERS' => ?BATCH_SENDERS, 'GAP_UNIT' => ?GAP_UNIT,
      'GAP_WEIGHT' => ?GAP_WEIGHT, 'GAP_CAP_US' => ?GAP_CAP_US,
      'OWN_GAP_CAP_US' => ?OWN_GAP_CAP_US, 'WINDOW_US' => ?WINDOW_US,
      'CALM_REUSE' => ?CALM_REUSE, 'SKIP_MAX' => ?SKIP_MAX}.

%% @doc How calm a lane is, from the microseconds since its previous small send
%% and the `bypass_after' window (`never': batching is forced).
-spec calm(integer(), non_neg_integer() | never) -> calm().
calm(_Gap, never) -> busy;
calm(Gap, Window) when Gap > Window, Gap > ?SETTLED_US -> settled;
calm(Gap, Window) when Gap > Window -> quiet;
calm(_Gap, _Window) -> busy.

%% @doc On a busy lane: whether the sender streams (its own previous small send
%% within the `bypass_after' window). A streaming sender keeps the lane: the lane
%% makes the distribution sends while the sender goes on, so the two run in
%% parallel even when batches are small.
-spec streams(integer(), non_neg_integer() | never) -> boolean().
streams(_OwnGap, never) -> true;
streams(OwnGap, Window) -> OwnGap =< Window.

%% @doc Whether a busy lane pays, as the lane judges it at `ShippedAt'
%% (microseconds, the lanes' clock: `convoy_slots:now_us/1') from its recent
%% batches of `BatchX16' (messages per distribution send, in sixteenths): `paid',
%% or until when it does not. Under a flood of many senders batches grow; with a
%% few request/response pairs they stay near one message, and senders go the way
%% plain `!' goes. Once `PROBE_US' has passed the lane is tried again. The lane
%% publishes this verdict (`convoy_slots:record_batch/4') so that a sender reads
%% one word.
-spec unpaid_until(non_neg_integer(), integer()) -> paid | integer().
unpaid_until(BatchX16, _ShippedAt) when BatchX16 >= ?PAYS_X16 -> paid;
unpaid_until(_BatchX16, ShippedAt) -> ShippedAt + ?PROBE_US.

%% @doc On a busy lane, for a sender that does not stream: `busy' (it takes the
%% lane) when enough senders take turns on the lane (`{LaneGap, OwnGap}',
%% see `convoy_slots:recent_gaps/1') and the lane's recent batches pay
%% (`unpaid_until/2'), or their verdict that they do not has expired at `Now' (the
%% lane is tried again); otherwise `unpaid' (it goes as if the lane were calm).
-spec pays(paid | integer(), integer(), {non_neg_integer(), non_neg_integer()}) ->
          busy | unpaid.
pays(_Verdict, _Now, Gaps) when not ?ENOUGH_SENDERS(Gaps) -> unpaid;
pays(paid, _Now, _Gaps) -> busy;
pays(UnpaidUntil, Now, _Gaps) when Now =< UnpaidUntil -> unpaid;
pays(_UnpaidUntil, _Now, _Gaps) -> busy.

%% @doc On a quiet lane (not settled): `busy' while enough senders take turns on
%% it and its batches pay. Under batching, a closed loop's messages come in
%% bursts (each answers the batch before) with pauses between them longer than
%% `bypass_after': the first message of a burst must not leave the batch.
-spec quiet(paid | integer(), {non_neg_integer(), non_neg_integer()}) -> busy | quiet.
quiet(paid, Gaps) when ?ENOUGH_SENDERS(Gaps) -> busy;
quiet(_Verdict, _Gaps) -> quiet.

%% @doc Before any admission: an unmarked sender sends a large message, or a small
%% one on a calm lane, directly.
-spec unadmitted(size(), calm(), Marked :: boolean()) -> direct | admit.
unadmitted(_Size, _Calm, true) -> admit;
unadmitted(large, _Calm, false) -> direct;
unadmitted(small, busy, false) -> admit;
unadmitted(small, _Calm, false) -> direct.

%% @doc After an admission: whether the message may bypass the lane, provided
%% the lane is idle (rule 2: the caller reads that only when this says yes; the
%% node's route then decides how, see `bypass/3'). A small message bypasses only
%% a calm lane.
-spec may_bypass(size(), calm()) -> boolean().
may_bypass(large, _Calm) -> true;
may_bypass(small, busy) -> false;
may_bypass(small, _Calm) -> true.

%% @doc How an admitted message that may bypass the lane goes, by the node's route.
-spec bypass(size(), calm(), route()) ->
          direct | inbox | inbox_barrier | barrier_direct | lane.
bypass(_Size, _Calm, none) -> lane;          % convoy has not dealt with the node yet
bypass(_Size, _Calm, unanswered) -> lane;    % no waits, nothing outside the bound
bypass(_Size, _Calm, plain) -> direct;       % no inbox: the lane shipped into the connection
bypass(large, _Calm, convoy) -> barrier_direct;
bypass(small, settled, convoy) -> inbox_barrier;
bypass(small, unpaid, convoy) -> inbox_barrier; % batching does not pay: direct again
bypass(small, _Calm, convoy) -> inbox.

%% @doc Whether a large message of `Bytes' (encoded) goes in pieces: from
%% `chunk_threshold' on, and only while there is small traffic to protect: a
%% small message took any lane within the last `chunk_guard'
%% milliseconds (`SinceSmallUs' microseconds ago), or always with `always'.
%% Pieces keep small messages from waiting behind a large one but cost bulk
%% throughput, so a node that only receives bulk gets it whole, as fast as `!'.
-spec pieces(non_neg_integer(), non_neg_integer() | infinity,
             {GuardMs :: non_neg_integer() | always, SinceSmallUs :: integer()}) -> boolean().
pieces(_Bytes, infinity, _Guard) -> false;
pieces(Bytes, Threshold, _Guard) when Bytes < Threshold -> false;
pieces(_Bytes, _Threshold, {always, _SinceSmallUs}) -> true;
pieces(_Bytes, _Threshold, {GuardMs, SinceSmallUs}) -> SinceSmallUs =< GuardMs * 1000.

%% @doc The bytes a node may hold with a message of `Bytes' (encoded) among them:
%% the node's bound `MaxBytes'; for a large message (from `LargeThreshold' on) no
%% more than its distribution connection buffers before it is busy (`ConnBytes',
%% the runtime's `dist_buf_busy_limit'). A large message reaches a lane when the
%% connection is full, and the lane cannot ship faster than the connection takes
%% it: a deeper backlog only held memory and made the lane's heap collections
%% decide a stream's pace (doc/decisions.md). A message alone may still exceed
%% the bound (`convoy_held').
-spec held_bytes(non_neg_integer(), non_neg_integer() | infinity, pos_integer() | infinity,
                 pos_integer()) -> pos_integer() | infinity.
held_bytes(Bytes, LargeThreshold, infinity, ConnBytes)
  when LargeThreshold =/= infinity, Bytes >= LargeThreshold ->
    ConnBytes;
held_bytes(Bytes, LargeThreshold, MaxBytes, ConnBytes)
  when LargeThreshold =/= infinity, Bytes >= LargeThreshold ->
    min(MaxBytes, ConnBytes);
held_bytes(_Bytes, _LargeThreshold, MaxBytes, _ConnBytes) ->
    MaxBytes.

%% @doc A multicast entry (always admitted: it goes through an inbox to be fanned
%% out there, or through the lane).
-spec multicast(size(), calm(), Idle :: boolean(), route()) -> inbox | lane.
multicast(large, _Calm, true, convoy) -> inbox;
multicast(small, Calm, true, convoy) when Calm =/= busy -> inbox;
multicast(_Size, _Calm, _Idle, _Route) -> lane.

%% @doc The path of an admitted message, from what its sender found: its size,
%% the lane's calm, the lane's view (`busy' while it holds admissions before the
%% message's, or when the message may not bypass it; else the node's route) and
%% whether a large message goes in pieces to the node (`convoy_chunk_send:inbox/4').
%% Every path but `lane' leaves the lane alone:
%% <ul>
%% <li>`direct': the caller sends to the destination (a plain peer: what the lane
%%   shipped is in the connection already);</li>
%% <li>`inbox', `inbox_barrier', `barrier_direct': see `bypass/3';</li>
%% <li>`pieces': in pieces through the lane's inbox, behind what the lane
%%   shipped; `drain_pieces' the same once the busy lane shipped what it holds
%%   for the node (the caller waits for that);</li>
%% <li>`lane': handed to the lane, within the node's bound (`overload/2').</li>
%% </ul>
-spec decide(size(), calm(), busy | route(), Pieces :: boolean()) ->
          direct | inbox | inbox_barrier | barrier_direct | pieces | drain_pieces | lane.
decide(large, _Calm, busy, true) -> drain_pieces;
decide(large, _Calm, _Route, true) -> pieces;
decide(_Size, _Calm, busy, _Pieces) -> lane;
decide(Size, Calm, Route, _Pieces) -> bypass(Size, Calm, Route).

%% @doc A message the node's bound has no room for, under the `overload' policy
%% `Policy', `MayWait' unless the node is known not to answer
%% (`convoy_metrics:may_wait_for_room/2'): the caller waits for room, or the
%% message is refused (`send/3' reports it) or dropped (`send/2' counts it).
-spec overload(block | drop | error, MayWait :: boolean()) -> wait | refuse.
overload(block, true) -> wait;
overload(_Policy, _MayWait) -> refuse.

%%--------------------------------------------------------------------
%% The sender's own part

%% @doc A sending process's state before its first remote send.
-spec own() -> own().
own() -> #own{}.

%% @doc An unmarked sender's small send: the calm it found at its last record,
%% taken as found (a direct send is always safe for an unmarked sender), while
%% it has sends left; else `record': it reads the clock and the lane.
-spec reuse(own()) -> {calm(), own()} | record.
reuse(Own = #own{calm = Calm, left = Left}) when Left > 0 -> {Calm, Own#own{left = Left - 1}};
reuse(_Own) -> record.

%% @doc An unmarked sender records a small send to `Node' at `Now': its own gap
%% per send since its last record to `Node', and how many small sends the record
%% stands for (itself and those that took a reused calm since the last one).
-spec unmarked_record(own(), node(), integer()) ->
          {OwnGap :: integer(), Sends :: pos_integer(), own()}.
unmarked_record(Own = #own{calm = Calm, left = Left, last = Last}, Node, Now) ->
    Sends = case Calm of
                none -> 1;
                _ -> 1 + ?CALM_REUSE - Left
            end,
    {(Now - own_last(Own, Node, Now)) div Sends, Sends,
     Own#own{calm = none, left = 0, last = Last#{Node => Now}}}.

%% @doc The calm an unmarked sender's record found: a calm one is reused for the
%% next `CALM_REUSE' small sends.
-spec found(own(), calm()) -> own().
found(Own, busy) -> Own;
found(Own, Calm) -> Own#own{calm = Calm, left = ?CALM_REUSE}.

%% @doc A marked sender's small send to `Node' on an idle lane, at `Now', having
%% skipped `Skipped' records since its last one, with the `bypass_after' window
%% `Window': `skip' (it streams, its own sends on average since its last record
%% within the window: it keeps the lane without recording, at most `SKIP_MAX' in
%% a row; its new count), or `record' with its own gap per send, the sends the
%% record stands for, and its count from now: 0 when the record finds it
%% streaming (its next sends skip on this clock reading), else `undefined'.
-spec marked_record(own(), non_neg_integer(), node(), integer(), non_neg_integer()) ->
          {skip, pos_integer()} |
          {record, OwnGap :: integer(), Sends :: pos_integer(), own(), 0 | undefined}.
marked_record(Own = #own{last = Last}, Skipped, Node, Now, Window) ->
    OwnGap = (Now - own_last(Own, Node, Now)) div (1 + Skipped),
    Streams = streams(OwnGap, Window),
    case Skipped < ?SKIP_MAX andalso Streams of
        true ->
            {skip, Skipped + 1};
        false ->
            Next = case Streams of
                       true -> 0;
                       false -> undefined
                   end,
            {record, OwnGap, 1 + Skipped, Own#own{last = Last#{Node => Now}}, Next}
    end.

%% @doc A marked sender's small send to its busy lane (the path does not depend
%% on the calm), its skip count `Skipped' (`undefined' when not counting): a sender
%% that its last clock reading found streaming (counting skips) skips this one's
%% record too, up to `SKIP_MAX' in a row; any other `record's it
%% (`marked_record/5').
-spec skip(undefined | non_neg_integer()) -> {skip, pos_integer()} | record.
skip(Skipped) when is_integer(Skipped), Skipped < ?SKIP_MAX -> {skip, Skipped + 1};
skip(_Skipped) -> record.

%% @doc The records a marked sender skipped since its last (`skipped()'), its
%% admission now the lane's `V'th (`none' when it has none): after a record held
%% behind the node's messages (`{since, V0}'), the lane's admissions between the
%% two, at most `SKIP_MAX' (exact for a sender alone on its lane; with others,
%% more than its own, as a record's gap per send is then read short anyway).
-spec counted(skipped(), integer() | none) -> non_neg_integer() | undefined.
counted({since, V0}, V) when is_integer(V) -> max(0, min(V - V0 - 1, ?SKIP_MAX));
counted({since, _V0}, none) -> 0;
counted(Skipped, _V) -> Skipped.

%% @doc A marked sender's small send held behind its node's messages, its
%% admission the lane's `V'th (`convoy_slots:admit_many/2', a count that only
%% grows): a sender that streams (`Skipped' counting) records only the lane's
%% every `SKIP_MAX' + 1th admission, the record standing for `SKIP_MAX' + 1 of
%% its sends (exact for a sender alone on its lane), and writes nothing
%% otherwise (`streaming': a sender known to count, its count not read); any
%% other sender records it as on an idle lane (`skip/1').
-spec held_record(skipped() | streaming, integer()) ->
          skip | {record, undefined | non_neg_integer()}.
held_record(Skipped, V) when Skipped =/= undefined ->
    case V rem (?SKIP_MAX + 1) of
        0 -> {record, ?SKIP_MAX};
        _ -> skip
    end;
held_record(undefined, _V) ->
    {record, undefined}.

%% @doc A multicast entry's small send to `Node' at `Now', recorded as one send:
%% the sender's own gap since its last record to `Node'. An entry reuses no calm
%% and leaves the sender's reuse as it is.
-spec entry_record(own(), node(), integer()) -> {OwnGap :: integer(), own()}.
entry_record(Own = #own{last = Last}, Node, Now) ->
    {Now - own_last(Own, Node, Now), Own#own{last = Last#{Node => Now}}}.

%% @doc The sender's last recorded small send to `Node' (for tests), `none'
%% before any.
-spec own_last(own(), node()) -> integer() | none.
own_last(#own{last = Last}, Node) -> maps:get(Node, Last, none).

own_last(#own{last = Last}, Node, Now) ->
    case Last of
        #{Node := T} -> T;
        _ -> long_ago(Now)
    end.

%% @doc A time (microseconds, the lanes' clock) far enough before `Now' to stand
%% for "no send yet": the clock can be negative, so no constant can.
-spec long_ago(integer()) -> integer().
long_ago(Now) -> Now - ?LONG_AGO_US.
