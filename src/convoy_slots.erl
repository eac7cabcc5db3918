%% @private
%% The shared counters of one outbound lane, and the only module that touches them.
%%
%% Each lane has its own `atomics' array (so replacing one lane replaces its
%% counters and nothing else) with these slots, each group on its own 64-byte
%% cache line so that senders bumping admissions and the lane publishing disposals
%% do not write the same line:
%% <ul>
%% <li>admitted: messages senders handed to the lane's path (`admit/1'); jumps by
%%   `?CLOSED' when the lane is retired, so a sender that lands at or above it knows
%%   to re-read the runtime;</li>
%% <li>disposed: admissions shipped, handed to distribution or dropped
%%   (`dispose/2'); when it equals the admissions before a sender's own, the lane is
%%   idle and everything it was given is already in the distribution layer;</li>
%% <li>last small send: microseconds of the latest small message on this lane, by
%%   the lanes' clock (`now_us/1'), read by every recorded small send (a
%%   streaming sender records one in 16, convoy_sender) and written only when
%%   the microsecond has moved on. It starts far in the past, never at 0: a
%%   monotonic clock can be negative. Beside it on the same line, moving averages
%%   of the gaps between those sends and of the gaps between each and its
%%   sender's previous one (`recent_gaps/1'), updated with it: how often small
%%   messages come to this lane, and from about how many senders taking turns,
%%   whichever path they then take.</li>
%% <li>batching: the verdict senders read (`record_batch/4', the lane alone):
%%   whether batching pays, judged over windows of the lane's shipments, or until
%%   when it does not (`unpaid_until/1', see `convoy_path:unpaid_until/2'). One
%%   word, read by a sender that does not stream on a small send to a busy or
%%   quiet lane, and written only when the lane judges a window of its
%%   shipments; the sums it judges, added to at every shipment, are on a line of
%%   their own.</li>
%% </ul>
-module(convoy_slots).

-export([new/2, clock/0, now_us/1, admit/1, admit_many/2, is_closed/1, dispose/2, idle/2,
         since_last_send/4, note_small_send/2, close/1, admitted/1, disposed/1, record_batch/4,
         batch_average/1, unpaid_until/1, last_small_send/1, recent_gaps/1]).

-export_type([slots/0, clock/0, gaps/0]).

%% A lane's admission counter jumps by this much when the lane is retired: a sender
%% whose add_get lands at or above it knows to re-read the runtime and go elsewhere.
-define(CLOSED, (1 bsl 58)).

-opaque slots() :: atomics:atomics_ref().
%% Ticks of os:perf_counter/0 per microsecond, or 0: erlang:monotonic_time/1.
-type clock() :: non_neg_integer().
%% The recent average gaps, in GAP_UNITths of a microsecond (`recent_gaps/1').
-type gaps() :: {Lane :: non_neg_integer(), Own :: non_neg_integer()}.

%% Eight 8-byte slots per cache line. An atomics array is not aligned to a line,
%% and every atomics call reads the array's length, stored just before slot 1: a
%% slot written by many within 64 bytes of it would make every call on the array
%% miss its cache. So the first slot used is 9, and each group of slots starts at
%% least 8 slots after the previous one ends, whatever the array's alignment.
-define(ADMITTED, 9).
-define(DISPOSED, 17).
-define(LAST_SEND, 25).
%% Both gap averages in one word, the lane's in the low LANE_GAP_BITS bits, its
%% senders' own above: every atomics call is a call of a built-in function,
%% and a small send makes several.
-define(GAPS, 26).
-define(LANE_GAP_BITS, 24).
-define(LANE_GAP_MASK, ((1 bsl ?LANE_GAP_BITS) - 1)).
%% The gaps' averaging constants (GAP_UNIT, GAP_WEIGHT, GAP_CAP_US, OWN_GAP_CAP_US)
%% and the batching window (WINDOW_US) are the policy's (convoy_policy.hrl).
-include("convoy_policy.hrl").
%% Written by the lane alone, read by senders: one line of their own, written
%% only when the lane judges a window (`judge/3'), so that while the verdict
%% holds, every sender's read of it finds the line in its own cache.
-define(BATCH, 34).
-define(UNPAID_UNTIL, 35).
%% `paid' in UNPAID_UNTIL: no time of the lanes' clock comes near it (a
%% monotonic clock can be negative, but not by 2^62 us, 146,000 years).
-define(PAID, -(1 bsl 62)).
%% While the verdict is `paid', the messages and distribution sends the lane
%% shipped since WINDOW_END - WINDOW_US, judged together at WINDOW_END: a ratio
%% of sums, so that one large batch weighs as many messages as it carries, and a
%% window, so that a lane tried again after a pause is judged once its batches
%% have had time to grow (a closed loop's first batches are small: its requests
%% come back at the pace of the path they took before).
%% The lane's own sums, written at every shipment: a line away from the verdict,
%% so that those writes do not take from every sender's cache the line it reads.
-define(MSGS, 43).
-define(SENDS, 44).
-define(WINDOW_END, 45).
-define(SIZE, 52).
%% Batch sizes are kept in sixteenths of a message.
-define(BATCH_ONE, 16).

%% @doc Counters for a new lane. `Behind' is how many disposals the lane starts
%% short of its admissions: 1 for a lane started held (no sender may see it idle
%% before it is released), 0 otherwise. `Clock' is the lanes' clock (`clock/0').
-spec new(0 | 1, clock()) -> slots().
new(Behind, Clock) ->
    A = atomics:new(?SIZE, [{signed, true}]),
    atomics:put(A, ?DISPOSED, -Behind),
    LongAgo = convoy_path:long_ago(now_us(Clock)),
    atomics:put(A, ?LAST_SEND, LongAgo),
    atomics:put(A, ?GAPS, pack(?GAP_CAP_US * ?GAP_UNIT, ?OWN_GAP_CAP_US * ?GAP_UNIT)),
    atomics:put(A, ?UNPAID_UNTIL, LongAgo),
    A.

%% @doc The lanes' clock on this node: every time in these slots, and every time
%% compared with one, is `now_us/1' of it. Monotonic microseconds with an origin
%% of their own, read from os:perf_counter/0 where it counts at least a tick per
%% microsecond: it costs a fraction of erlang:monotonic_time/1. Steering only: no order and no timer depends on it. The OS's
%% performance counter (nanoseconds on Linux) is documented as possibly not
%% monotonic: a step back would make lanes look busy for the step's length (their
%% small messages then batched), never reorder anything.
-spec clock() -> clock().
clock() -> erlang:convert_time_unit(1, microsecond, perf_counter).

%% @doc Now by the lanes' clock (`clock/0'), in microseconds.
-spec now_us(clock()) -> integer().
now_us(0) -> erlang:monotonic_time(microsecond);
now_us(TicksPerUs) -> os:perf_counter() div TicksPerUs.

%% @doc Take one admission; returns the admission's number (compare with
%% `is_closed/1' and `idle/2').
-spec admit(slots()) -> integer().
admit(A) -> atomics:add_get(A, ?ADMITTED, 1).

%% @doc Take `K' admissions at once (`convoy:send_many/1'); returns the last one's
%% number.
-spec admit_many(slots(), pos_integer()) -> integer().
admit_many(A, K) -> atomics:add_get(A, ?ADMITTED, K).

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

%% @doc When a small message last took the lane (microseconds, the lanes' clock), read
%% only.
-spec last_small_send(slots()) -> integer().
last_small_send(A) -> atomics:get(A, ?LAST_SEND).

%% @doc Record a small send at `Now' (microseconds, the lanes' clock) that stands
%% for `Sends' small sends of its sender (those it made since the last it
%% recorded, itself included), `OwnGap' microseconds per send after its
%% sender's previous one; returns the microseconds since the lane's previous
%% recorded small send (0 or less when another sender already recorded this
%% microsecond or a later one), with the recent gaps as updated by this send, or
%% `unread' when it did not update them (`recent_gaps/1' reads them). The lane's
%% gap is averaged per send (divided by `Sends'): exact for a sender alone on its
%% lane; with others recording in between it makes the lane look busier than it
%% is, which batches, as convoy did before senders skipped any records. A read, and
%% plain writes only when the time moves forward: a flood of senders mostly reads
%% the line instead of taking it in turn. Two senders racing across a microsecond may both see the older time
%% (both measure the gap before either send), and, as with the `exchange' this
%% replaces, a sender delayed between the clock and the write may leave a
%% slightly older time: either only makes a gap look longer by the race's length.
%% The lane's ordering never depends on it.
-spec since_last_send(slots(), integer(), integer(), pos_integer()) ->
          {integer(), gaps() | unread}.
since_last_send(A, Now, OwnGap, Sends) ->
    case atomics:get(A, ?LAST_SEND) of
        Last when Last < Now ->
            atomics:put(A, ?LAST_SEND, Now),
            %% Unsynchronised, as the time above: a race loses a sample, and
            %% the averages only steer a choice between safe paths.
            {Lane0, Own0} = recent_gaps(A),
            Gaps = {average(Lane0, min((Now - Last) div Sends, ?GAP_CAP_US)),
                    average(Own0, max(0, min(OwnGap, ?OWN_GAP_CAP_US)))},
            atomics:put(A, ?GAPS, pack(Gaps)),
            {Now - Last, Gaps};
        Last ->
            {Now - Last, unread}
    end.

%% @doc A small message took the lane at `Now' (microseconds, the lanes' clock),
%% where batching is forced and no average is read: the last small send moves
%% forward only, the averages are not touched.
-spec note_small_send(slots(), integer()) -> ok.
note_small_send(A, Now) ->
    case atomics:get(A, ?LAST_SEND) of
        Last when Last < Now -> atomics:put(A, ?LAST_SEND, Now);
        _ -> ok
    end.

average(Old, Us) -> Old + ((Us * ?GAP_UNIT - Old) div ?GAP_WEIGHT).

pack({Lane, Own}) -> pack(Lane, Own).

pack(Lane, Own) -> (Own bsl ?LANE_GAP_BITS) bor Lane.

%% @doc The recent average gaps, in 256ths of a microsecond, between small
%% sends on this lane (`GAP_CAP_US' for a lane that had none lately) and between
%% each of those and its sender's previous one: their ratio is about how many
%% senders take turns on the lane.
-spec recent_gaps(slots()) -> gaps().
recent_gaps(A) ->
    Gaps = atomics:get(A, ?GAPS),
    {Gaps band ?LANE_GAP_MASK, Gaps bsr ?LANE_GAP_BITS}.

%% @doc The lane shipped `Msgs' messages in `Sends' distribution sends at `NowUs'
%% (microseconds, the lanes' clock). Only the lane writes these slots. While the verdict
%% is `paid' the lane counts what it ships and judges it at the end of each
%% window (`convoy_path:unpaid_until/2'); while it says unpaid, nothing is
%% judged (senders bypass the lane, what it ships says little); once that has
%% expired, the shipment means senders try the lane again: `paid' for a window.
-spec record_batch(slots(), non_neg_integer(), non_neg_integer(), integer()) -> ok.
record_batch(_A, _Msgs, 0, _NowUs) ->
    ok;
record_batch(A, Msgs, Sends, NowUs) ->
    case atomics:get(A, ?UNPAID_UNTIL) of
        ?PAID ->
            M = atomics:add_get(A, ?MSGS, Msgs),
            S = atomics:add_get(A, ?SENDS, Sends),
            case NowUs >= atomics:get(A, ?WINDOW_END) of
                true -> judge(A, M * ?BATCH_ONE div S, NowUs);
                false -> ok
            end;
        Until when NowUs > Until ->
            atomics:put(A, ?UNPAID_UNTIL, ?PAID),
            window(A, Msgs, Sends, NowUs);
        _Until ->
            ok
    end.

judge(A, BatchX16, NowUs) ->
    atomics:put(A, ?BATCH, BatchX16),
    case convoy_path:unpaid_until(BatchX16, NowUs) of
        paid -> window(A, 0, 0, NowUs);
        Until -> atomics:put(A, ?UNPAID_UNTIL, Until)
    end.

window(A, Msgs, Sends, NowUs) ->
    atomics:put(A, ?MSGS, Msgs),
    atomics:put(A, ?SENDS, Sends),
    atomics:put(A, ?WINDOW_END, NowUs + ?WINDOW_US).

%% @doc Messages per distribution send the lane achieved in its last window
%% judged, in sixteenths of a message.
-spec batch_average(slots()) -> non_neg_integer().
batch_average(A) -> atomics:get(A, ?BATCH).

%% @doc `paid' when the lane's recent batches say that going through it pays;
%% otherwise until when (microseconds, the lanes' clock) they say it does not: long ago
%% before the lane's first shipment.
-spec unpaid_until(slots()) -> paid | integer().
unpaid_until(A) ->
    case atomics:get(A, ?UNPAID_UNTIL) of
        ?PAID -> paid;
        Until -> Until
    end.

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
    A = new(0, clock()),
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
    A = new(1, clock()),
    ?assertNot(idle(A, admit(A))),
    ok = dispose(A, 1),
    ?assertNot(idle(A, admit(A))).

%% The lanes' clock counts microseconds, whichever counter it reads.
clock_counts_microseconds_test() ->
    [begin
         T0 = now_us(Clock),
         M0 = erlang:monotonic_time(microsecond),
         timer:sleep(50),
         Us = now_us(Clock) - T0,
         Mono = erlang:monotonic_time(microsecond) - M0,
         ?assert(Us >= 50000),
         ?assert(abs(Us - Mono) < 5000)
     end || Clock <- [clock(), 0]].

first_send_is_long_after_test() ->
    A = new(0, clock()),
    ?assert(gap(since_last_send(A, now_us(clock()), 0, 1)) > 1000000),
    G = gap(since_last_send(A, now_us(clock()), 0, 1)),
    ?assert(G >= 0 andalso G < 1000000).

%% The gap is measured from the previous send, written only as time moves on.
gap_since_previous_send_test() ->
    A = new(0, clock()),
    _ = since_last_send(A, now_us(clock()), 0, 1),
    T0 = now_us(clock()),
    Last = atomics:get(A, ?LAST_SEND),
    ?assert(Last =< T0),
    wait_until(T0 + 3),
    ?assert(gap(since_last_send(A, now_us(clock()), 0, 1)) >= 3),
    ?assert(atomics:get(A, ?LAST_SEND) >= T0 + 3),
    %% A later time already recorded (another sender's) is not overwritten.
    Later = now_us(clock()) + 1000000,
    atomics:put(A, ?LAST_SEND, Later),
    ?assertMatch({G, unread} when G < 0, since_last_send(A, now_us(clock()), 0, 1)),
    ?assertEqual(Later, atomics:get(A, ?LAST_SEND)).

%% The gaps between small sends are averaged (a new lane: as if long apart); a
%% long pause counts as GAP_CAP_US and is forgotten after a couple of hundred sends.
%% Beside them, each sender's gap since its own previous send (at most
%% OWN_GAP_CAP_US): with 6 senders taking turns, 6 times the lane's.
recent_gaps_test() ->
    A = new(0, clock()),
    ?assertEqual({?GAP_CAP_US * ?GAP_UNIT, ?OWN_GAP_CAP_US * ?GAP_UNIT}, recent_gaps(A)),
    T0 = -5000000, % the clock can be negative
    [_ = since_last_send(A, T0 + 5 * I, 30, 1) || I <- lists:seq(0, 599)],
    %% A send that updates the averages returns them as it wrote them.
    {5, Updated} = since_last_send(A, T0 + 5 * 600, 30, 1),
    ?assertEqual(Updated, recent_gaps(A)),
    ?assertEqual({5, 30}, gaps_us(A)),
    {0, unread} = since_last_send(A, T0 + 5 * 600, 1 bsl 40, 1), % the same microsecond
    ?assertEqual({5, 30}, gaps_us(A)),
    _ = since_last_send(A, T0 + 10000000, 1 bsl 40, 1),
    ?assertEqual({5 + (?GAP_CAP_US - 5) div ?GAP_WEIGHT, 30 + (?OWN_GAP_CAP_US - 30) div ?GAP_WEIGHT},
                 gaps_us(A)),
    [_ = since_last_send(A, T0 + 10000000 + 2 * I, -1, 1) || I <- lists:seq(1, 200)],
    {Lane, Own} = gaps_us(A),
    ?assert(Lane =< 3 andalso Own =< 3).

%% A send that stands for several (its sender skipped recording the others)
%% counts its gaps per send: one sender alone on a lane, sending every 10 us and
%% recording one send in 4, is seen sending every 10 us.
recorded_for_several_test() ->
    A = new(0, clock()),
    T0 = -3000000,
    [_ = since_last_send(A, T0 + 40 * I, 10, 4) || I <- lists:seq(0, 600)],
    ?assertEqual({10, 10}, gaps_us(A)),
    %% the gap returned is the lane's whole gap since the previous record
    ?assertMatch({40, _}, since_last_send(A, T0 + 40 * 601, 10, 4)).

gap({Gap, _Gaps}) -> Gap.

gaps_us(A) ->
    {Lane, Own} = recent_gaps(A),
    {Lane div ?GAP_UNIT, Own div ?GAP_UNIT}.

%% The verdict: a new lane has none (long ago: senders try it); its first
%% shipment opens a window in which it counts as paid, judged at the window's end
%% from all its shipments together (messages per distribution send, in
%% sixteenths); a window whose batches did not pay makes it unpaid for a while,
%% during which nothing is judged; the first shipment after that opens a window
%% again. The clock can be negative.
batching_window_test() ->
    A = new(0, clock()),
    ?assertEqual(0, batch_average(A)),
    ?assert(now_us(clock()) - unpaid_until(A) > 1000000),
    T0 = -7000000,
    ok = record_batch(A, 1, 1, T0),
    ?assertEqual(paid, unpaid_until(A)),
    ok = record_batch(A, 0, 0, T0 + 1), % nothing sent: nothing learnt
    ok = record_batch(A, 1, 1, T0 + ?WINDOW_US - 1),
    ?assertEqual(paid, unpaid_until(A)),
    ok = record_batch(A, 100, 1, T0 + ?WINDOW_US), % one large batch weighs its messages
    ?assertEqual(102 * 16 div 3, batch_average(A)),
    ?assertEqual(paid, unpaid_until(A)),
    T1 = T0 + ?WINDOW_US,
    [ok = record_batch(A, 1, 1, T1 + I) || I <- lists:seq(1, 20)],
    ok = record_batch(A, 3, 2, T1 + ?WINDOW_US),
    ?assertEqual(23 * 16 div 22, batch_average(A)),
    Unpaid = unpaid_until(A),
    ?assertEqual(Unpaid, convoy_path:unpaid_until(23 * 16 div 22, T1 + ?WINDOW_US)),
    ?assert(is_integer(Unpaid) andalso Unpaid > T1 + ?WINDOW_US),
    ok = record_batch(A, 50, 1, Unpaid), % while unpaid: nothing judged
    ?assertEqual({23 * 16 div 22, Unpaid}, {batch_average(A), unpaid_until(A)}),
    ok = record_batch(A, 1, 1, Unpaid + 1), % expired: tried again
    ?assertEqual(paid, unpaid_until(A)),
    ok = record_batch(A, 1, 1, Unpaid + 1 + ?WINDOW_US),
    ?assertEqual(16, batch_average(A)),
    ?assertNotEqual(paid, unpaid_until(A)).

wait_until(T) ->
    case now_us(clock()) >= T of
        true -> ok;
        false -> wait_until(T)
    end.
-endif.
