%% @private
%% A lane's courier: the process that waits out one node's busy connection for
%% its lane (`convoy_lane'). It makes blocking sends of what it was given, then of
%% each lot its lane gives it next (`give/2'), in order; it reports each lot once
%% sent, so that the lane disposes of it at once, and ends when the lane answers
%% a report that it gave it nothing more since (`stop/1'): its exit reason is
%% `{courier, done}'. What it is given waits in its mailbox, off its heap.
%%
%% Under `compress => auto' a lot may be a metered batch (`{metered, ...}' op):
%% the courier compresses it or not at the level its lane last set
%% (`set_level/2', `convoy_compress_auto'; a row of the lane's table of levels,
%% which only the lane writes) when it comes to send it, not when it
%% was given (a backlog is given at once, and the level may change while it
%% waits), and puts behind its entries the meter that measures it: the peer's
%% inbox answers the lane with its time once it delivered the batch
%% (`convoy_wire:meter/2').
-module(convoy_courier).

-export([new_levels/0, start/4, give/2, stop/1, set_level/2, done/1]).

-export_type([courier/0, levels/0, op/0, report/0]).

-include("convoy_tags.hrl").

-record(courier, {pid :: pid(), ref :: reference(), levels :: ets:tid()}).
-opaque courier() :: #courier{}.
%% A lane's couriers' levels: a table the lane writes, its couriers read.
-opaque levels() :: ets:tid().

%% A blocking send of a term to a destination and the messages it carries; a
%% metered batch's entries to an inbox with their size, at the peer's version,
%% and the meter's tag (`{Secret, Node}': its answer is
%% `{{Secret, Node, convoy_compress_auto:tag()}, convoy_meter, Time}'); messages
%% counted sent without a send (`skip') or lost (`lost').
-type op() :: {pid() | atom() | {atom(), node()} | reference(), term(), non_neg_integer()}
            | {metered, {atom(), node()}, pos_integer(), [convoy_wire:entry()],
               {pos_integer(), non_neg_integer()}, {reference(), node()}}
            | {skip | lost, none, non_neg_integer()}.
%% What a lot's report carries: messages sent, sends made, messages lost, and
%% each batch sent compressed: its messages, their bytes and its compressed size.
-type report() :: {{non_neg_integer(), non_neg_integer(), non_neg_integer()},
                   [{pos_integer(), non_neg_integer(), pos_integer()}]}.

%% @doc A table of levels for the calling lane's couriers.
-spec new_levels() -> levels().
new_levels() ->
    ets:new(?MODULE, [set, protected, {read_concurrency, true}]).

%% @doc A courier for the calling lane, with its first lot, compressing metered
%% batches at `Level' until told otherwise (its row in `Levels'). Linked to the
%% caller.
-spec start([op()], never | 1..9, levels(), pid()) -> {pid(), courier()}.
start(Ops, Level, Levels, Lane) ->
    Ref = make_ref(),
    true = ets:insert(Levels, {Ref, Level}),
    Pid = spawn_opt(fun() -> lot(Lane, {Ref, Levels}, 1, Ops) end,
                    [link, {message_queue_data, off_heap}]),
    {Pid, #courier{pid = Pid, ref = Ref, levels = Levels}}.

%% @doc Its next lot, sent after what it carries.
-spec give(courier(), [op()]) -> ok.
give(#courier{pid = Pid, ref = Ref}, Ops) ->
    Pid ! {Ref, ops, Ops},
    ok.

%% @doc It reported every lot it was given: it ends.
-spec stop(courier()) -> ok.
stop(#courier{pid = Pid, ref = Ref}) ->
    Pid ! {Ref, stop},
    ok.

%% @doc The level metered batches it has not sent yet are compressed at.
-spec set_level(courier(), never | 1..9) -> ok.
set_level(#courier{ref = Ref, levels = Levels}, Level) ->
    true = ets:insert(Levels, {Ref, Level}),
    ok.

%% @doc It ended: its row goes.
-spec done(courier()) -> ok.
done(#courier{ref = Ref, levels = Levels}) ->
    true = ets:delete(Levels, Ref),
    ok.

%% Each lot: sent, then reported as `{?TAG_COURIER_SENT, Pid, Lot, report()}'.
lot(Lane, {Ref, _Levels} = Row, Lot, Ops) ->
    Lane ! {?TAG_COURIER_SENT, self(), Lot, run(Ops, {Lane, Row, Lot}, {0, 0, 0}, [])},
    receive
        {Ref, ops, More} -> lot(Lane, Row, Lot + 1, More);
        {Ref, stop} -> exit({courier, done})
    end.

%% Blocking sends (they wait out a busy distribution buffer, never connect).
run([], _Lot, Counts, Zipped) ->
    {Counts, Zipped};
run([{skip, none, W} | Rest], Lot, {Msgs, Sends, Lost}, Z) ->
    run(Rest, Lot, {Msgs + W, Sends, Lost}, Z);
run([{lost, none, W} | Rest], Lot, {Msgs, Sends, Lost}, Z) ->
    run(Rest, Lot, {Msgs, Sends, Lost + W}, Z);
run([{metered, Target, Vsn, Entries, {W, _Bytes} = Size, {Secret, Node}} | Rest],
    Lot = {Lane, {Ref, Levels}, N}, Counts, Z) ->
    {Level, Mode} = case ets:lookup_element(Levels, Ref, 2) of
                        never -> {never, plain};
                        L -> {L, zip}
                    end,
    Tag = {Ref, N, Mode, W},
    Metered = Entries ++ [convoy_wire:meter(Lane, {Secret, Node, Tag})],
    case convoy_compress:shipped(node(), Metered, Size, Level, Vsn) of
        {Batch, plain} -> run([{Target, Batch, W} | Rest], Lot, Counts, Z);
        {ZBatch, Zipped} -> run([{Target, ZBatch, W} | Rest], Lot, Counts, [Zipped | Z])
    end;
run([{Dest, Term, W} | Rest], Lot, {Msgs, Sends, Lost}, Z) ->
    case erlang:send(Dest, Term, [noconnect]) of
        ok -> run(Rest, Lot, {Msgs + W, Sends + 1, Lost}, Z);
        noconnect -> run(Rest, Lot, {Msgs, Sends, Lost + W}, Z)
    end.

-ifdef(TEST).
-include_lib("eunit/include/eunit.hrl").

events(N) ->
    [{self(), {event, I, <<"user-42">>, #{k => I, body => binary:copy(<<"abc">>, 50)}}}
     || I <- lists:seq(1, N)].

report() ->
    receive {?TAG_COURIER_SENT, _Pid, Lot, Report} -> {Lot, Report}
    after 5000 -> error(no_report)
    end.

%% A metered lot: compressed at the level set when it is sent (not when it was
%% given), with the meter behind its entries saying its courier, lot, mode and
%% messages; each lot reported with what it
%% compressed; the courier ends when told, `{courier, done}'.
metered_lots_test() ->
    Trap = process_flag(trap_exit, true),
    true = register(convoy_courier_test_inbox, self()),
    try
        Target = {convoy_courier_test_inbox, node()},
        Es = events(20),
        Size = {20, lists:sum([erlang:external_size(M) || {_, M} <- Es])},
        Secret = make_ref(),
        Metered = {metered, Target, 4, Es, Size, {Secret, n@h}},
        Levels = new_levels(),
        {Pid, C} = start([{self(), first, 1}], 1, Levels, self()),
        first = receive first -> first after 5000 -> none end,
        ?assertEqual({1, {{1, 1, 0}, []}}, report()),
        %% given two lots at once: the level changes before the second is sent
        ok = set_level(C, 1),
        ok = give(C, [Metered]),
        {'$convoy', 1, zbatch, _, Bin} = receive Z -> Z after 5000 -> none end,
        {ok, Decoded} = convoy_compress:decode(Bin),
        {Es, [{'$convoy_meter', Lane, {Secret, n@h, {_, 2, zip, 20}}}]} =
            lists:split(20, Decoded),
        ?assertEqual(self(), Lane),
        {2, {{20, 1, 0}, [{20, In, Out}]}} = report(),
        ?assert(Out < In),
        ok = set_level(C, never),
        ok = give(C, [Metered]),
        {'$convoy', 1, batch, _, Plain} = receive P -> P after 5000 -> none end,
        ?assertMatch([{'$convoy_meter', _, {Secret, n@h, {_, 3, plain, 20}}}],
                     lists:nthtail(20, Plain)),
        ?assertEqual({3, {{20, 1, 0}, []}}, report()),
        ok = stop(C),
        ?assertEqual({courier, done}, receive {'EXIT', Pid, R} -> R after 5000 -> none end),
        ok = done(C),
        ?assertEqual(0, ets:info(Levels, size))
    after
        unregister(convoy_courier_test_inbox),
        process_flag(trap_exit, Trap)
    end.

-endif.
