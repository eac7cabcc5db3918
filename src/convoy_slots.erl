%% @private
%% The shared counters of one outbound lane, and the only module that touches them.
%%
%% Each lane has its own `atomics' array (so replacing one lane replaces its
%% counters and nothing else) with three slots, each on its own 64-byte cache line
%% so that senders bumping admissions and the lane publishing disposals do not
%% write the same line:
%% <ul>
%% <li>admitted: messages senders handed to the lane's path (`admit/1'); jumps by
%%   `?CLOSED' when the lane is retired, so a sender that lands at or above it knows
%%   to re-read the runtime;</li>
%% <li>disposed: admissions shipped, handed to distribution or dropped
%%   (`dispose/2'); when it equals the admissions before a sender's own, the lane is
%%   idle and everything it was given is already in the distribution layer;</li>
%% <li>last small send: monotonic microseconds of the latest small message on this
%%   lane (`since_last_send/2'), read by every small send and written only when
%%   the microsecond has moved on. It starts far in the past, never at 0: the
%%   monotonic clock can be negative. Beside it on the same line, a moving
%%   average of the gaps between those sends (`recent_gap/1'), updated with it:
%%   how often small messages come to this lane, whichever path they then take.</li>
%% <li>batching: a moving average of the messages per distribution send the lane
%%   achieved lately, and the verdict senders read (`record_batch/4', the lane
%%   alone): until when batching does not pay (`unpaid_until/1', see
%%   `convoy_path:unpaid_until/2'). One word, read by a sender that does not
%%   stream on every small send to a busy lane, and written only as the lane
%%   ships.</li>
%% </ul>
-module(convoy_slots).

-export([new/1, admit/1, is_closed/1, dispose/2, idle/2, since_last_send/2, close/1,
         admitted/1, disposed/1, record_batch/4, batch_average/1, unpaid_until/1,
         long_ago/1, last_small_send/1, recent_gap/1]).

-export_type([slots/0]).

%% A lane's admission counter jumps by this much when the lane is retired: a sender
%% whose add_get lands at or above it knows to re-read the runtime and go elsewhere.
-define(CLOSED, (1 bsl 58)).

-opaque slots() :: atomics:atomics_ref().

%% Eight 8-byte slots per cache line.
-define(ADMITTED, 1).
-define(DISPOSED, 9).
-define(LAST_SEND, 17).
-define(GAP, 18).
%% Gaps are averaged in sixteenths of a microsecond, each new one weighing 1/8
%% and counted at most GAP_CAP_US: one long pause is forgotten after a few dozen
%% sends.
-define(GAP_CAP_US, 1000).
%% Written by the lane alone, read by senders: one line of their own.
-define(BATCH, 25).
-define(UNPAID_UNTIL, 26).
-define(SIZE, 32).
%% Batch sizes are kept in sixteenths of a message; each new batch weighs 1/4.
-define(BATCH_ONE, 16).
%% "Long ago" for the last small send: any first send is quiet.
-define(LONG_AGO_US, (1 bsl 40)).

%% @doc Counters for a new lane. `Behind' is how many disposals the lane starts
%% short of its admissions: 1 for a lane started held (no sender may see it idle
%% before it is released), 0 otherwise.
-spec new(0 | 1) -> slots().
new(Behind) ->
    A = atomics:new(?SIZE, [{signed, true}]),
    atomics:put(A, ?DISPOSED, -Behind),
    LongAgo = long_ago(erlang:monotonic_time(microsecond)),
    atomics:put(A, ?LAST_SEND, LongAgo),
    atomics:put(A, ?GAP, ?GAP_CAP_US * 16),
    atomics:put(A, ?UNPAID_UNTIL, LongAgo),
    A.

%% @doc Take one admission; returns the admission's number (compare with
%% `is_closed/1' and `idle/2').
%% @doc A time (monotonic microseconds) far enough before `Now' to stand for "no
%% send yet": the clock can be negative, so no constant can.
-spec long_ago(integer()) -> integer().
long_ago(Now) -> Now - ?LONG_AGO_US.

-spec admit(slots()) -> integer().
admit(A) -> atomics:add_get(A, ?ADMITTED, 1).

%% @doc Whether an admission number was taken after the lane was closed.
-spec is_closed(integer()) -> boolean().
is_closed(V) -> V >= ?CLOSED.

%% @doc `K' admissions were disposed of.
-spec dispose(slots(), non_neg_integer()) -> ok.
dispose(_A, 0) -> ok;
dispose(A, K) -> atomics:add(A, ?DISPOSED, K).

%% @doc True when every admission before admission `V' has been disposed of.
-spec idle(slots(), integer()) -> boolean().
idle(A, V) -> atomics:get(A, ?DISPOSED) =:= V - 1.

%% @doc Record a small send at `Now' (monotonic microseconds); returns the
%% microseconds since the previous one
%% (0 or less when another sender already recorded this microsecond or a later one).
%% A read, and a plain write only when the time moves forward: a flood of senders
%% mostly reads the line instead of taking it in turn. Two senders racing across a
%% microsecond may both see the older time (both measure the gap before either
%% send), and, as with the `exchange' this replaces, a sender delayed between the
%% clock and the write may leave a slightly older time: either only makes a gap
%% look longer by the race's length. The lane's ordering never depends on it.
%% @doc When a small message last took the lane (monotonic microseconds), read
%% only.
-spec last_small_send(slots()) -> integer().
last_small_send(A) -> atomics:get(A, ?LAST_SEND).

-spec since_last_send(slots(), integer()) -> integer().
since_last_send(A, Now) ->
    case atomics:get(A, ?LAST_SEND) of
        Last when Last < Now ->
            atomics:put(A, ?LAST_SEND, Now),
            %% Unsynchronised, as the time above: a race loses a sample, and
            %% the average only steers a choice between safe paths.
            Old = atomics:get(A, ?GAP),
            atomics:put(A, ?GAP, Old + ((min(Now - Last, ?GAP_CAP_US) * 16 - Old) div 8)),
            Now - Last;
        Last ->
            Now - Last
    end.

%% @doc The recent average gap between small sends on this lane, in microseconds
%% (`GAP_CAP_US' for a lane that had none lately).
-spec recent_gap(slots()) -> non_neg_integer().
recent_gap(A) -> atomics:get(A, ?GAP) div 16.

%% @doc The lane shipped `Msgs' messages in `Sends' distribution sends at `NowUs'
%% (monotonic microseconds). Only the lane writes these slots.
-spec record_batch(slots(), non_neg_integer(), non_neg_integer(), integer()) -> ok.
record_batch(_A, _Msgs, 0, _NowUs) ->
    ok;
record_batch(A, Msgs, Sends, NowUs) ->
    Old = atomics:get(A, ?BATCH),
    %% bsr floors: the average settles on, or just under, what batches achieve
    New = Old + ((Msgs * ?BATCH_ONE div Sends - Old) bsr 2),
    atomics:put(A, ?BATCH, New),
    Until = case convoy_path:unpaid_until(New, NowUs) of
                paid -> long_ago(NowUs);
                T -> T
            end,
    atomics:put(A, ?UNPAID_UNTIL, Until).

%% @doc Messages per distribution send the lane achieved lately, in sixteenths of
%% a message.
-spec batch_average(slots()) -> non_neg_integer().
batch_average(A) -> atomics:get(A, ?BATCH).

%% @doc Until when (monotonic microseconds) the lane's recent batches say that
%% going through it does not pay; long ago when they say it does, or before the
%% lane's first shipment.
-spec unpaid_until(slots()) -> integer().
unpaid_until(A) -> atomics:get(A, ?UNPAID_UNTIL).

%% @doc Close the lane to new admissions; returns how many it granted. Closing a
%% closed lane changes nothing.
-spec close(slots()) -> non_neg_integer().
close(A) ->
    case atomics:get(A, ?ADMITTED) of
        V when V >= ?CLOSED ->
            V - ?CLOSED;
        V ->
            case atomics:compare_exchange(A, ?ADMITTED, V, V + ?CLOSED) of
                ok -> V;
                _ -> close(A)
            end
    end.

%% @doc Admissions granted so far (closed or not).
-spec admitted(slots()) -> non_neg_integer().
admitted(A) ->
    case atomics:get(A, ?ADMITTED) of
        V when V >= ?CLOSED -> V - ?CLOSED;
        V -> V
    end.

%% @doc Admissions disposed of so far.
-spec disposed(slots()) -> integer().
disposed(A) -> atomics:get(A, ?DISPOSED).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

idle_and_close_test() ->
    A = new(0),
    V1 = admit(A),
    ?assert(idle(A, V1)),
    V2 = admit(A),
    ?assertNot(idle(A, V2)),
    ok = dispose(A, 1),
    ?assert(idle(A, V2)),
    ?assertEqual(2, close(A)),
    ?assertEqual(2, close(A)),
    ?assert(is_closed(admit(A))),
    ?assertEqual(3, admitted(A)).

held_lane_is_never_idle_test() ->
    A = new(1),
    ?assertNot(idle(A, admit(A))),
    ok = dispose(A, 1),
    ?assertNot(idle(A, admit(A))).

first_send_is_long_after_test() ->
    A = new(0),
    ?assert(since_last_send(A, erlang:monotonic_time(microsecond)) > 1000000),
    G = since_last_send(A, erlang:monotonic_time(microsecond)),
    ?assert(G >= 0 andalso G < 1000000).

%% The gap is measured from the previous send, written only as time moves on.
gap_since_previous_send_test() ->
    A = new(0),
    _ = since_last_send(A, erlang:monotonic_time(microsecond)),
    T0 = erlang:monotonic_time(microsecond),
    Last = atomics:get(A, ?LAST_SEND),
    ?assert(Last =< T0),
    wait_until(T0 + 3),
    ?assert(since_last_send(A, erlang:monotonic_time(microsecond)) >= 3),
    ?assert(atomics:get(A, ?LAST_SEND) >= T0 + 3),
    %% A later time already recorded (another sender's) is not overwritten.
    Later = erlang:monotonic_time(microsecond) + 1000000,
    atomics:put(A, ?LAST_SEND, Later),
    ?assert(since_last_send(A, erlang:monotonic_time(microsecond)) < 0),
    ?assertEqual(Later, atomics:get(A, ?LAST_SEND)).

%% The gaps between small sends are averaged (a new lane: as if long apart); a
%% long pause counts as GAP_CAP_US and is forgotten after a few dozen sends.
recent_gap_test() ->
    A = new(0),
    ?assertEqual(?GAP_CAP_US, recent_gap(A)),
    T0 = -5000000, % the clock can be negative
    [_ = since_last_send(A, T0 + 5 * I) || I <- lists:seq(0, 60)],
    ?assertEqual(5, recent_gap(A)),
    _ = since_last_send(A, T0 + 5 * 60), % the same microsecond: no sample
    ?assertEqual(5, recent_gap(A)),
    _ = since_last_send(A, T0 + 10000000),
    ?assertEqual(5 + (?GAP_CAP_US - 5) div 8, recent_gap(A)),
    [_ = since_last_send(A, T0 + 10000000 + 2 * I) || I <- lists:seq(1, 40)],
    ?assert(recent_gap(A) =< 3).

%% Batches are averaged (each new one weighs a quarter), in sixteenths of a
%% message; a new lane has no recent batch, so it is not unpaid. The clock can be
%% negative.
batching_average_test() ->
    A = new(0),
    ?assertEqual(0, batch_average(A)),
    ?assert(erlang:monotonic_time(microsecond) - unpaid_until(A) > 1000000),
    ok = record_batch(A, 8, 1, -5),
    ?assertEqual(32, batch_average(A)),
    ?assertEqual(long_ago(-5), unpaid_until(A)), % batches of 2 pay
    [ok = record_batch(A, 1, 1, T) || T <- lists:seq(-20, -1)],
    B = batch_average(A),
    ?assert(B >= 16 andalso B < 20),
    Unpaid = unpaid_until(A),
    ?assertEqual(Unpaid, convoy_path:unpaid_until(B, -1)),
    ?assert(Unpaid > -1),
    ok = record_batch(A, 0, 0, 21), % nothing sent: nothing learnt
    ?assertEqual({B, Unpaid}, {batch_average(A), unpaid_until(A)}).

wait_until(T) ->
    case erlang:monotonic_time(microsecond) >= T of
        true -> ok;
        false -> wait_until(T)
    end.
-endif.
