%% @private
%% A sending process's own state, and the lane's calm as that sender finds it.
%%
%% The state is one entry of the sender's process dictionary (`?KEY', an atom:
%% it hashes and compares at once), a `#sender{}' with four parts:
%% <ul>
%% <li>`marked': the nodes this sender's traffic went to through a lane or an
%%   inbox since its last barrier (rule 3 of `convoy_send'), each `true', or
%%   `{pieces, Inbox}' while its last message in pieces went through the peer's
%%   `Inbox' unconfirmed and everything it sent to the node since went straight
%%   to that inbox;</li>
%% <li>`own': its part of the adaptive policy (`convoy_path:own()': the calm it
%%   reuses, its last recorded small send to each node);</li>
%% <li>`skipped': the records a marked sender skipped in a row while it
%%   streams (`undefined' otherwise), or the lane's admission its last record
%%   held behind the node's messages took (`{since, V}'), from which the
%%   lane's admissions count them (`convoy_path:counted/2');</li>
%% <li>`refs': the counters and held array of each node it streams to, as it read
%%   them under the lanes then running (`held_refs/2').</li>
%% </ul>
%% What it collects inside `convoy:batch/1' is kept apart (`convoy_scope').
%% A process that never sent remotely has no entry, and the paths that need no
%% state (a fresh process's first send to a busy node) write none.
-module(convoy_sender).

-export([marker/1, marked/2, is_marked/1, mark/1, mark_lane/1, mark_pieces/2, confirmed/1,
         unmark/1]).
-export([unmarked_calm/3, marked_calm/3, unheld_calm/5, entry_calm/3]).
-export([held_refs/2, held_record/5, forget_refs/1]).
-export([parts/0]).

-export_type([marker/0]).

-include("convoy_runtime.hrl").

-define(KEY, '$convoy_sender').

-type marker() :: false | true | {pieces, atom()}.

-record(sender, {marked = #{} :: #{node() => true | {pieces, atom()}},
                 own :: convoy_path:own() | undefined,
                 skipped :: convoy_path:skipped(),
                 refs = #{} :: #{node() => {tuple(), counters:counters_ref(),
                                            convoy_held:held()}}}).

-compile({inline, [state/0, set_marked/2, slots/2, now_us/1]}).

%%--------------------------------------------------------------------
%% The marker

state() ->
    case get(?KEY) of
        undefined -> #sender{};
        S -> S
    end.

%% @doc The calling process's marker for `Node'.
-spec marker(node()) -> marker().
marker(Node) ->
    case get(?KEY) of
        #sender{marked = #{Node := Marker}} -> Marker;
        _ -> false
    end.

%% @doc `marker/1', or for a sender marked `true' that streams (it counts its
%% skipped records) and kept `Node''s row under `Lanes' (`held_refs/2'), that
%% row: a flood's every send reads its state once, and makes no term to learn
%% it (`held_record/5' with `streaming').
-spec marked(node(), tuple()) ->
          marker() | {tuple(), counters:counters_ref(), convoy_held:held()}.
marked(Node, Lanes) ->
    case get(?KEY) of
        #sender{marked = #{Node := true}, skipped = Skipped,
                refs = #{Node := {Lanes, _C, _H} = Refs}} when Skipped =/= undefined ->
            Refs;
        #sender{marked = #{Node := Marker}} ->
            Marker;
        _ ->
            false
    end.

%% @doc Whether the calling process's traffic to `Node' went through a lane or
%% an inbox since its last barrier.
-spec is_marked(node()) -> boolean().
is_marked(Node) ->
    marker(Node) =/= false.

%% @doc Marks `Node' for a message sent straight to an inbox, keeping a
%% `{pieces, Inbox}' marker as it is: the message is in the connection behind
%% the pieces.
-spec mark(node()) -> ok.
mark(Node) ->
    case get(?KEY) of
        #sender{marked = #{Node := _}} -> ok;
        _ -> set_marked(Node, true)
    end.

%% @doc Marks `Node' for a message handed to the lane: the marker is `true',
%% whatever it was. The lane may still hold the message, so nothing may go
%% straight to the inbox of a `{pieces, Inbox}' marker any more. Nor need it:
%% the lane ships to that inbox, behind the pieces, and whatever confirms the
%% lane's traffic confirms them too.
-spec mark_lane(node()) -> ok.
mark_lane(Node) ->
    case get(?KEY) of
        #sender{marked = #{Node := true}} -> ok;
        _ -> set_marked(Node, true)
    end.

%% @doc A message in pieces went through the peer's `Inbox' unconfirmed.
-spec mark_pieces(node(), atom()) -> ok.
mark_pieces(Node, Inbox) ->
    set_marked(Node, {pieces, Inbox}).

%% @doc The pieces' inbox confirmed them; the sender's lane may hold traffic.
-spec confirmed(node()) -> ok.
confirmed(Node) ->
    set_marked(Node, true).

%% @doc A barrier confirmed everything the sender sent to `Node'.
-spec unmark(node()) -> ok.
unmark(Node) ->
    case get(?KEY) of
        S = #sender{marked = #{Node := _} = Marked} ->
            put(?KEY, S#sender{marked = maps:remove(Node, Marked)}),
            ok;
        _ ->
            ok
    end.

set_marked(Node, Marker) ->
    S = #sender{marked = Marked} = state(),
    put(?KEY, S#sender{marked = Marked#{Node => Marker}}),
    ok.

%%--------------------------------------------------------------------
%% A node's row

%% @doc `{Lanes, C, H}': `Node''s counters and held array (`convoy_peers:refs/1'),
%% read once per node while `Lanes' run, then kept (a flood's sender would
%% otherwise read them at each send, and reading a `persistent_term' by a tuple
%% key hashes it; a streaming sender finds them with its marker, `marked/2'). A
%% row convoy_peers forgets is closed first, and the sender that finds it closed
%% forgets it here (`forget_refs/1'); a convoy started again runs other lanes.
%% `undefined' while convoy's tree is torn down.
-spec held_refs(tuple(), node()) ->
          {tuple(), counters:counters_ref(), convoy_held:held()} | undefined.
held_refs(Lanes, Node) ->
    case get(?KEY) of
        #sender{refs = #{Node := {Lanes, _C, _H} = Refs}} -> Refs;
        _ -> keep_refs(Lanes, Node)
    end.

keep_refs(Lanes, Node) ->
    case convoy_peers:refs(Node) of
        {C, H} ->
            S = #sender{refs = Kept} = state(),
            Refs = {Lanes, C, H},
            put(?KEY, S#sender{refs = Kept#{Node => Refs}}),
            Refs;
        undefined ->
            undefined
    end.

%% @doc `Node''s row as kept was closed: read it again next time.
-spec forget_refs(node()) -> ok.
forget_refs(Node) ->
    case get(?KEY) of
        S = #sender{refs = #{Node := _} = Kept} ->
            put(?KEY, S#sender{refs = maps:remove(Node, Kept)}),
            ok;
        _ ->
            ok
    end.

%% @doc The calling process's state, by part (for tests).
-spec parts() -> #{marked := #{node() => true | {pieces, atom()}},
                   own := convoy_path:own() | undefined, skipped := non_neg_integer() | undefined,
                   refs := #{node() => tuple()}}.
parts() ->
    #sender{marked = Marked, own = Own, skipped = Skipped, refs = Refs} = state(),
    #{marked => Marked, own => Own, skipped => Skipped, refs => Refs}.

%%--------------------------------------------------------------------
%% The lane's calm as the sender finds it (its arithmetic: convoy_path)

%% @doc An unmarked sender's small send. A sender that found its lane calm takes
%% that calm as found for its next CALM_REUSE small sends: they go directly
%% without the clock or the lane's shared line. A direct send is always safe for
%% an unmarked sender. The next recorded send stands for the sends taken since
%% the last one: its gaps count per send, so a sender that starts to stream, or
%% many that take turns, are seen as before. A process's first send to a node for
%% which convoy holds messages answers `{held, C, H}' (`first_calm/4').
-spec unmarked_calm(#runtime{}, pos_integer(), node()) ->
          convoy_path:calm() | {held, counters:counters_ref(), convoy_held:held()}.
unmarked_calm(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node) when is_integer(W) ->
    case get(?KEY) of
        undefined -> first_calm(RT, L, Node, #sender{});
        #sender{own = undefined} = S -> first_calm(RT, L, Node, S);
        #sender{own = Own} = S -> unmarked_calm(RT, L, Node, S, Own)
    end;
unmarked_calm(RT, L, _Node) ->
    forced(RT, L).

%% A process's first small send: while convoy holds messages for the node, it
%% takes the lane as busy without reading the lane's calm or keeping state, and
%% with the node's refs (`{held, C, H}') its room is taken without reading them
%% again. Most processes whose first send finds the node busy send once (the
%% seed's flood of fresh pingers), and that state would die with them; one that
%% goes on streams into its lane, marked.
first_calm(RT, L, Node, S) ->
    case convoy_peers:refs(Node) of
        {C, H} ->
            case convoy_held:is_empty(H) of
                false -> {held, C, H};
                true -> record_unmarked(RT, L, Node, S, convoy_path:own())
            end;
        undefined ->
            record_unmarked(RT, L, Node, S, convoy_path:own())
    end.

unmarked_calm(RT, L, Node, S, Own0) ->
    case convoy_path:reuse(Own0) of
        {Calm, Own} ->
            put(?KEY, S#sender{own = Own}),
            Calm;
        record ->
            record_unmarked(RT, L, Node, S, Own0)
    end.

record_unmarked(RT, L, Node, S, Own0) ->
    Now = now_us(RT),
    {OwnGap, Sends, Own} = convoy_path:unmarked_record(Own0, Node, Now),
    Calm = calm(RT, L, Now, OwnGap, Sends, direct),
    put(?KEY, S#sender{own = convoy_path:found(Own, Calm)}),
    Calm.

%% @doc A marked sender's small send on an idle lane. It records at most one
%% small send in SKIP_MAX + 1 on its lane, the recorded one standing for the
%% skipped ones in the lane's averages: a sender that streams (its own sends, on
%% average since its last record, within `bypass_after') keeps the lane without
%% recording. So a flood's sender reads the clock and writes the lane's shared
%% line rarely, and the lane's last small send, which tells other senders and
%% large messages that the lane is in use, stays at most SKIP_MAX + 1 of its
%% sends old.
-spec marked_calm(#runtime{}, pos_integer(), node()) -> convoy_path:calm().
marked_calm(RT, L, Node) ->
    marked_calm(RT, L, Node, none).

%% `marked_calm/3' after the sender's admission, the lane's `V'th (`none' before
%% one: the lane's count is read if the sender's own count needs it).
marked_calm(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node, V) when is_integer(W) ->
    S = #sender{skipped = Skipped0} = state(),
    marked_calm(RT, L, Node, S, counted(RT, L, Skipped0, V), 0);
marked_calm(RT, L, _Node, _V) ->
    forced(RT, L).

%% `marked_calm/4' on the state `S', its skipped records counted `Skipped0'; a
%% record that finds the sender streaming counts from `Streaming' on.
marked_calm(RT = #runtime{bypass_after = W}, L, Node, S = #sender{own = Own0}, Skipped0,
            Streaming) ->
    Now = now_us(RT),
    case convoy_path:marked_record(own(Own0), skipped(Skipped0), Node, Now, W) of
        {skip, Skipped} ->
            put(?KEY, S#sender{skipped = Skipped}),
            busy;
        {record, OwnGap, Sends, Own, Next} ->
            Skipped = case Next of
                          0 -> Streaming;
                          undefined -> undefined
                      end,
            put(?KEY, S#sender{own = Own, skipped = Skipped}),
            calm(RT, L, Now, OwnGap, Sends, lane)
    end.

%% The records the sender skipped since its last: after one held behind the
%% node's messages, counted by the lane's admissions since (`convoy_path:counted/2').
counted(RT, L, {since, _} = Skipped, none) ->
    convoy_path:counted(Skipped, convoy_slots:admitted(slots(RT, L)));
counted(_RT, _L, Skipped, V) ->
    convoy_path:counted(Skipped, V).

%% @doc With nothing held for the node, a marked sender's lane as its small send
%% finds it, `Idle' after its admission (the lane's `V'th) or not: busy while the
%% lane still holds admitted messages (recorded as a skip), else its calm.
-spec unheld_calm(#runtime{}, pos_integer(), node(), boolean(), integer()) ->
          convoy_path:calm().
unheld_calm(RT, L, Node, Idle, V) ->
    case Idle of
        false ->
            skipped_record(RT, L, Node, V),
            busy;
        true ->
            marked_calm(RT, L, Node, V)
    end.

%% A marked sender's small send to its busy lane, nothing held for the node (the
%% path does not depend on the lane's calm). A sender that its last clock
%% reading found streaming skips this one's clock and record too, up to
%% SKIP_MAX in a row; any other sender records it: the lane's last small send
%% and averages stay as fresh as its senders' traffic, which the calm of every
%% other sender on the lane reads.
skipped_record(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node, V) when is_integer(W) ->
    S = #sender{skipped = Skipped0} = state(),
    case convoy_path:skip(convoy_path:counted(Skipped0, V)) of
        {skip, Skipped} ->
            put(?KEY, S#sender{skipped = Skipped}),
            ok;
        record ->
            _ = marked_calm(RT, L, Node, V),
            ok
    end;
skipped_record(RT, L, _Node, _V) ->
    busy = forced(RT, L),
    ok.

%% @doc A marked sender's small send held behind the node's messages, its
%% admission the lane's `V'th (`streaming': `marked/2' found it counting its
%% skipped records; `unread': read its state): a sender that streams writes
%% nothing, and reads nothing, but at one admission in `SKIP_MAX' + 1 of the
%% lane's, where it records (`convoy_path:held_record/2').
-spec held_record(streaming | unread, #runtime{}, pos_integer(), node(), integer()) -> ok.
held_record(Known, RT = #runtime{bypass_after = W, max_delay = 0}, L, Node, V)
  when is_integer(W) ->
    Skipped = case Known of
                  streaming -> streaming;
                  unread -> (state())#sender.skipped
              end,
    case convoy_path:held_record(Skipped, V) of
        skip -> ok;
        {record, Stands} -> _ = marked_calm(RT, L, Node, state(), Stands, {since, V}), ok
    end;
held_record(_Known, RT, L, _Node, _V) ->
    busy = forced(RT, L),
    ok.

%% @doc A multicast entry's small send to `Node': recorded on the lane as one
%% send (an entry reuses no calm and leaves the sender's reuse as it is), and how
%% calm the lane was before it.
-spec entry_calm(#runtime{}, pos_integer(), node()) -> convoy_path:calm().
entry_calm(RT = #runtime{bypass_after = W, max_delay = 0}, L, Node) when is_integer(W) ->
    Now = now_us(RT),
    S = #sender{own = Own0} = state(),
    {OwnGap, Own} = convoy_path:entry_record(own(Own0), Node, Now),
    put(?KEY, S#sender{own = Own}),
    calm(RT, L, Now, OwnGap, 1, direct);
entry_calm(RT, L, _Node) ->
    forced(RT, L).

own(undefined) -> convoy_path:own();
own(Own) -> Own.

skipped(undefined) -> 0;
skipped(N) -> N.

%% The lane's calm at `Now', with the sender's own gap per send already known.
%% How long the lane has been without a small message depends on where the
%% sender's unrecorded sends went: `direct' (an unmarked sender's reused calm),
%% so the lane's gap since its last record counts per send; or `lane' (a marked
%% sender's skipped records), so its own previous send took the lane at the
%% latest `OwnGap' ago, as if it had been recorded.
calm(RT = #runtime{bypass_after = W}, L, Now, OwnGap, Sends, Unrecorded) ->
    Slots = slots(RT, L),
    {LaneGap, Gaps} = convoy_slots:since_last_send(Slots, Now, OwnGap, Sends),
    Gap = case Unrecorded of
              direct -> LaneGap div Sends;
              lane -> min(LaneGap, OwnGap)
          end,
    case convoy_path:calm(Gap, W) of
        busy ->
            case convoy_path:streams(OwnGap, W) of
                true ->
                    busy;
                false ->
                    convoy_path:pays(convoy_slots:unpaid_until(Slots), Now, gaps(Slots, Gaps))
            end;
        quiet ->
            convoy_path:quiet(convoy_slots:unpaid_until(Slots), gaps(Slots, Gaps));
        Settled ->
            Settled
    end.

%% The gaps as this send updated them, or as the lane holds them.
gaps(Slots, unread) -> convoy_slots:recent_gaps(Slots);
gaps(_Slots, Gaps) -> Gaps.

%% Batching forced (`max_delay' set, or `bypass_after' `never'): the lane is
%% never calm, and no average is read. The small send's time is noted all the
%% same: a large message that follows goes in pieces behind it
%% (`convoy_path:pieces/3').
forced(RT, L) ->
    ok = convoy_slots:note_small_send(slots(RT, L), now_us(RT)),
    busy.

slots(#runtime{slots = Slots}, L) -> element(L, Slots).

now_us(#runtime{clock = Clock}) -> convoy_slots:now_us(Clock).

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

%% One read answers the marker and, marked `true' and streaming, the node's row
%% as kept under the lanes running.
marked_test() ->
    try
        ?assertEqual(false, marked(n@h, {lane})),
        ok = mark_lane(n@h),
        ?assertEqual(true, marked(n@h, {lane})),
        {C, _} = convoy_metrics:new_refs(),
        Refs = {{lane}, C, convoy_held:new()},
        put(?KEY, (get(?KEY))#sender{refs = #{n@h => Refs}}),
        ?assertEqual(true, marked(n@h, {lane})), % kept, but not streaming
        put(?KEY, (get(?KEY))#sender{skipped = 0}),
        ?assertEqual(Refs, marked(n@h, {lane})),
        ?assertEqual(true, marked(n@h, {other_lane})), % kept under lanes gone
        ?assertEqual(false, marked(m@h, {lane})),
        ok = mark_pieces(n@h, inbox_1),
        ?assertEqual({pieces, inbox_1}, marked(n@h, {lane}))
    after
        erase(?KEY)
    end.

%% Held behind its node's messages, a streaming sender writes neither its state
%% nor the lane's line but at one admission in SKIP_MAX + 1 of the lane's, where
%% it records (the lane's last small send moves on, and its own).
held_record_test() ->
    #{'SKIP_MAX' := Max} = convoy_path:constants(),
    Clock = convoy_slots:clock(),
    Slots = convoy_slots:new(0, Clock),
    RT = #runtime{bypass_after = 20, max_delay = 0, slots = {Slots}, clock = Clock},
    try
        %% records close together: the sender streams (it counts skips)
        [_ = marked_calm(RT, 1, n@h) || _ <- lists:seq(1, 3 * Max)],
        #sender{skipped = Skipped} = get(?KEY),
        ?assert(is_integer(Skipped)),
        Streaming = get(?KEY),
        Last = convoy_slots:last_small_send(Slots),
        timer:sleep(2), % the lanes' clock moves on
        Period = Max + 1,
        [begin
             ok = held_record(unread, RT, 1, n@h, V),
             ok = held_record(streaming, RT, 1, n@h, V), % as marked/2 found it
             ?assertEqual(Streaming, get(?KEY)),
             ?assertEqual(Last, convoy_slots:last_small_send(Slots))
         end || V <- lists:seq(Period + 1, 2 * Period - 1)],
        ok = held_record(unread, RT, 1, n@h, 2 * Period),
        Recorded = convoy_slots:last_small_send(Slots),
        ?assert(Recorded > Last),
        ?assertNotEqual(Streaming, get(?KEY)),
        %% `streaming' records at the same admissions, reading the state then
        timer:sleep(2),
        Again = get(?KEY),
        ok = held_record(streaming, RT, 1, n@h, 3 * Period - 1),
        ?assertEqual({Again, Recorded}, {get(?KEY), convoy_slots:last_small_send(Slots)}),
        ok = held_record(streaming, RT, 1, n@h, 3 * Period),
        ?assert(convoy_slots:last_small_send(Slots) > Recorded),
        ?assertNotEqual(Again, get(?KEY))
    after
        erase(?KEY)
    end.

-endif.
